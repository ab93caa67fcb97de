"""Linear layers through oneDNN with weights packed once, for float32 on CPU.

PyTorch's default CPU matmul is fast for one row and slow for a few: on the 2-core EPYC this
project measures on, a 576 -> 1536 SmolLM2 projection takes 110 us for 1 row, 546 us for 4 and
614 us for 8, while oneDNN with a pre-packed weight takes 130, 188 and 296 us
(scripts/cpu_linear_bench.py, docs/benchmarks.md).
A verify forward (1 + drafts rows) and a batch of requests are exactly "a few rows", so the torch
engine on CPU runs its target's linear layers this way. Results differ from the default kernels
in the last float32 bits only (as kernels for different row counts already do).

A layer whose weight is NVFP4 as stored (formats.qformats.QuantLinear.stored) runs calls of up to
dflash.cpu_fp16.max_rows() rows through that module's float16 kernel instead: half the bytes.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_trt.dflash import cpu_fp16

PACK_ROWS = 8  # the row count oneDNN packs for; any row count runs


def available() -> bool:
    """oneDNN's packed linear exists in this PyTorch build."""
    ops = getattr(torch.ops, "mkldnn", None)
    return torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise") \
        and hasattr(ops, "_reorder_linear_weight")


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None):
    """x (..., in) @ W.T + bias with W packed by `pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """`inner` (an nn.Linear, or a QuantLinear whose input transform runs first) with its matmul
    through a packed copy of its weight."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.packed = pack(inner.weight)
        self.fp16 = None  # (W16 blocked, g) where dflash.cpu_fp16 runs the few-row calls
        self.fp16_rows = 0  # the most rows such a call has (cpu_fp16.max_rows)
        stored = getattr(inner, "stored", None)
        if stored is not None and cpu_fp16.fits(*inner.weight.shape) and cpu_fp16.load() is not None:
            self.fp16 = (cpu_fp16.blocked(stored.unscaled()), float(stored.weight_scale_2))
            self.fp16_rows = cpu_fp16.max_rows()
        if stored is not None:
            inner.stored = None  # read once; it is not needed again

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.inner.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prepare = getattr(self.inner, "prepare_input", None)
        if prepare is not None:
            x = prepare(x)
        rows = x.numel() // x.shape[-1]
        if 0 < rows <= self.fp16_rows:
            y = cpu_fp16.linear(x.reshape(rows, -1), *self.fp16).reshape(*x.shape[:-1], -1)
            return y if self.inner.bias is None else y + self.inner.bias
        return packed_linear(x, self.packed, self.inner.bias)


def _packable(module: nn.Module) -> bool:
    """An nn.Linear, or a layer that is one after its `prepare_input` (formats.qformats'
    QuantLinear), in float32 on CPU."""
    linear = type(module) is nn.Linear or (callable(getattr(module, "prepare_input", None))
                                           and isinstance(getattr(module, "weight", None),
                                                          torch.Tensor))
    return linear and module.weight.dtype == torch.float32 and module.weight.device.type == "cpu"


def is_plain(module: nn.Module) -> bool:
    """A bias-free linear map x @ W.T with nothing applied to x first (packed or not)."""
    inner = module.inner if isinstance(module, PackedLinear) else module
    return type(inner) is nn.Linear and inner.bias is None


def pack_linears(root: nn.Module) -> int:
    """Swap every float32 linear layer under `root` for a PackedLinear; returns how many."""
    swaps = [(parent, name, child) for parent in root.modules()
             for name, child in parent.named_children() if _packable(child)]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
