"""Random inputs for the DFlash ops and the kernel-vs-reference comparison, shared by the unit
tests (tiny shapes, Triton interpreter) and tests/gpu (production shapes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import load_tolerances


@dataclass(frozen=True)
class DrafterShape:
    """Drafter dimensions. QWEN3_8B is the Qwen3-8B DFlash drafter (block 16, 5 target layers)."""

    hidden: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    num_target_layers: int  # k: target layers whose features are concatenated
    block_size: int
    vocab: int


QWEN3_8B = DrafterShape(hidden=4096, num_q_heads=32, num_kv_heads=8, head_dim=128, num_layers=5,
                        num_target_layers=5, block_size=16, vocab=151936)


def rope_tables(positions: Tensor, head_dim: int, theta: float = 1e6) -> tuple[Tensor, Tensor]:
    """cos, sin [T, D] for absolute positions [T] (HF layout: the two halves repeat)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((angles, angles), dim=-1)  # [T, D]
    return emb.cos(), emb.sin()


def kv_inject_inputs(shape: DrafterShape, num_tokens: int, start: int, dtype: torch.dtype,
                     device: str | torch.device = "cpu", seed: int = 0) -> tuple:
    """Arguments of kv_inject for `num_tokens` new context tokens at positions start.."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rand(*size, scale=1.0):
        return (torch.randn(*size, generator=g) * scale).to(device=device, dtype=dtype)

    h, d, kv = shape.hidden, shape.head_dim, shape.num_kv_heads
    k_h = shape.num_target_layers * h
    cos, sin = rope_tables(torch.arange(start, start + num_tokens), d)
    return (
        rand(num_tokens, k_h),  # features [T, k*H]
        rand(h, k_h, scale=k_h ** -0.5),  # fc [H, k*H]
        1.0 + rand(h, scale=0.1),  # hidden_norm [H]
        [rand(kv * d, h, scale=h ** -0.5) for _ in range(shape.num_layers)],  # k_proj
        [rand(kv * d, h, scale=h ** -0.5) for _ in range(shape.num_layers)],  # v_proj
        [1.0 + rand(d, scale=0.1) for _ in range(shape.num_layers)],  # k_norm
        cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype),
        1e-6,
    )


def attention_inputs(shape: DrafterShape, num_ctx: int, dtype: torch.dtype,
                     device: str | torch.device = "cpu", seed: int = 0) -> tuple:
    """q [Hq, B, D], k_ctx, v_ctx [Hkv, T, D], k_blk, v_blk [Hkv, B, D] (unit-RMS keys, like k_norm)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hq, hkv, b, d = shape.num_q_heads, shape.num_kv_heads, shape.block_size, shape.head_dim

    def rand(*size):
        return torch.randn(*size, generator=g).to(device=device, dtype=dtype)

    return rand(hq, b, d), rand(hkv, num_ctx, d), rand(hkv, num_ctx, d), rand(hkv, b, d), rand(hkv, b, d)


def accept_inputs(num_blocks: int, num_draft: int, vocab: int, dtype: torch.dtype,
                  device: str | torch.device = "cpu", seed: int = 0, sharpness: float = 3.0):
    """(draft_tokens, target_probs, draft_probs, uniforms) for rejection sampling; the drafts are
    sampled from draft_probs, and target and draft share part of their logits so that blocks are
    partly accepted. For greedy, pass target_probs alone."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    shared = torch.randn(num_blocks, num_draft + 1, vocab, generator=g) * sharpness
    target = shared + torch.randn(shared.shape, generator=g)  # [N, g+1, V]
    draft = shared[:, :num_draft] + torch.randn(num_blocks, num_draft, vocab, generator=g)
    p, q = target.softmax(-1), draft.softmax(-1)
    tokens = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).view(num_blocks, num_draft)
    u = torch.rand(num_blocks, num_draft + 1, generator=g)
    return (tokens.to(device), p.to(device=device, dtype=dtype), q.to(device=device, dtype=dtype),
            u.to(device))


@dataclass(frozen=True)
class Comparison:
    """Kernel vs reference on one case: the largest errors and whether they are within tolerance."""

    op: str
    dtype: str
    max_abs_err: float
    max_rel_err: float  # max |kernel - ref| / (|ref| + abs_tol)
    abs_tol: float
    rel_tol: float
    ok: bool


def compare(op: str, got: Tensor, want: Tensor) -> Comparison:
    """Check got against want with tolerances.yaml[op][dtype] (torch.allclose semantics)."""
    dtype = str(want.dtype).removeprefix("torch.")
    tol = load_tolerances()[op][dtype]
    got64, want64 = got.double(), want.double()
    err = (got64 - want64).abs()
    ok = bool(got.shape == want.shape and (err <= tol["abs_tol"] + tol["rel_tol"] * want64.abs()).all())
    rel = (err / (want64.abs() + max(tol["abs_tol"], 1e-12))).max().item() if err.numel() else 0.0
    return Comparison(op, dtype, err.max().item() if err.numel() else 0.0, rel,
                      tol["abs_tol"], tol["rel_tol"], ok)
