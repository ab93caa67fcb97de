"""The DFlash ops, registered with torch.library as `torch.ops.dflash.<name>`.

Registering them as custom ops (with fake implementations for shape inference) lets them compose
with torch.compile and CUDA graphs. Each op runs its Triton kernel on CUDA and the pure-torch
reference elsewhere; `set_backend` (or DFLASH_TRT_OPS_BACKEND) overrides that choice:
"reference" everywhere, or "triton" everywhere (on CPU that needs TRITON_INTERPRET=1 set before
the first kernel import, which is how CI runs the kernels).
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch
from torch import Tensor

from . import reference

BACKENDS = ("auto", "reference", "triton")
_backend = os.environ.get("DFLASH_TRT_OPS_BACKEND", "auto")


def set_backend(name: str) -> None:
    """Choose the implementation: "auto" (Triton on CUDA, reference elsewhere), "reference", "triton"."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown DFlash ops backend {name!r}; choose one of {', '.join(BACKENDS)}")
    _backend = name


def get_backend() -> str:
    """The backend set by set_backend or DFLASH_TRT_OPS_BACKEND (default "auto")."""
    return _backend


def triton_available() -> bool:
    """True when the Triton kernels can be imported (triton-lang installed)."""
    # find_spec, not import: importing the kernels decides, once, between compiled and
    # interpreted mode (TRITON_INTERPRET), and this check must not make that choice early.
    return importlib.util.find_spec("triton") is not None


def _impl(device: torch.device) -> ModuleType:
    """The module whose function runs for tensors on `device`: kernels or reference."""
    if _backend == "reference" or (_backend == "auto" and device.type != "cuda"):
        return reference
    try:
        from . import kernels
    except ImportError:
        if _backend == "triton":
            raise
        return reference  # CUDA without triton-lang: still correct, just not fused
    return kernels


@torch.library.custom_op("dflash::kv_inject", mutates_args=())
def kv_inject(
    features: Tensor,
    fc_weight: Tensor,
    hidden_norm_weight: Tensor,
    k_proj_weights: list[Tensor],
    v_proj_weights: list[Tensor],
    k_norm_weights: list[Tensor],
    cos: Tensor,
    sin: Tensor,
    eps: float,
) -> Tensor:
    """Context features [T, k*H] -> kv [L, 2, Hkv, T, D]; see reference.kv_inject."""
    return _impl(features.device).kv_inject(
        features, fc_weight, hidden_norm_weight, k_proj_weights, v_proj_weights,
        k_norm_weights, cos, sin, eps,
    )


@kv_inject.register_fake
def _(features, fc_weight, hidden_norm_weight, k_proj_weights, v_proj_weights, k_norm_weights,
      cos, sin, eps):
    head_dim = k_norm_weights[0].shape[0]
    shape = (len(k_proj_weights), 2, k_proj_weights[0].shape[0] // head_dim, features.shape[0],
             head_dim)
    return features.new_empty(shape)


@torch.library.custom_op("dflash::block_draft_attention", mutates_args=())
def block_draft_attention(
    q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, window: int = 0
) -> Tensor:
    """Block queries [Hq, B, D] over context + block K/V -> [Hq, B, D]; see the reference."""
    return _impl(q.device).block_draft_attention(q, k_ctx, v_ctx, k_blk, v_blk, window)


@block_draft_attention.register_fake
def _(q, k_ctx, v_ctx, k_blk, v_blk, window=0):
    return torch.empty_like(q)


@torch.library.custom_op("dflash::accept", mutates_args=())
def _accept_op(
    draft_tokens: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor | None = None,
    uniforms: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    return _impl(target_probs.device).accept(draft_tokens, target_probs, draft_probs, uniforms)


@_accept_op.register_fake
def _(draft_tokens, target_probs, draft_probs=None, uniforms=None):
    num_blocks = draft_tokens.shape[0]
    return (draft_tokens.new_empty(num_blocks, dtype=torch.int64),
            draft_tokens.new_empty(num_blocks, dtype=torch.int64))


def accept(
    draft_tokens: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor | None = None,
    uniforms: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """Greedy (draft_probs None) or rejection-sampling acceptance over N blocks.

    draft_tokens [N, g], target_probs [N, g+1, V], draft_probs [N, g, V]; for sampling, pass the
    uniforms [N, g+1] or a generator they are drawn from (torch.rand, float32, on the probs'
    device). Returns (num_accepted [N], next_token [N]), int64. See reference.accept.
    """
    if draft_probs is not None and uniforms is None:
        num_blocks, num_draft = draft_tokens.shape
        uniforms = torch.rand((num_blocks, num_draft + 1), generator=generator,
                              device=target_probs.device)
    return _accept_op(draft_tokens, target_probs, draft_probs, uniforms)
