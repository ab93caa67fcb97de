"""Quantized checkpoint formats in pure torch: NVFP4, FP8, INT4 (AWQ).

This module is how the torch engine *runs* a ModelOpt unified HF checkpoint on any device
(`formats.load` builds the models): weights are dequantized once at load, and activations are
fake-quantized on every forward exactly as the format prescribes, so the CPU engine computes what
the quantized model computes. It never imports modelopt; the quantize stage reuses `nvfp4_fake_quantize` as ModelOpt's CPU backend so that the
numbers seen during calibration are the numbers served.

Formats (per quantized Linear, as ModelOpt exports them):
  NVFP4 / W4A16_NVFP4: weight uint8 [out, in/2] (two E2M1 codes per byte, even element in the low
      nibble), weight_scale float8_e4m3fn [out, in/16], weight_scale_2 fp32 scalar (amax/(6*448)),
      input_scale fp32 scalar (NVFP4 only: the activation's global scale, amax/(6*448)).
  FP8: weight float8_e4m3fn [out, in], weight_scale and input_scale fp32 scalars (amax/448).
  W4A16_AWQ: weight uint8 [out/2, in] (two signed int4 rows per byte, even row in the low nibble),
      weight_scale [out, in/group], optional pre_quant_scale [in].
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

E2M1_MAX = 6.0
E4M3_MAX = 448.0
NVFP4_BLOCK_SIZE = 16
# Magnitudes of the eight E2M1 codes; code | 8 is the negative of code.
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

QUANT_CONFIG_FILE = "hf_quant_config.json"
# quant_algo values (hf_quant_config.json) this module can run.
NVFP4 = "NVFP4"
W4A16_NVFP4 = "W4A16_NVFP4"
FP8 = "FP8"
W4A16_AWQ = "W4A16_AWQ"
SUPPORTED_ALGOS = (NVFP4, W4A16_NVFP4, FP8, W4A16_AWQ)


# --------------------------------------------------------------------------------------------
# E2M1 codes


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round values (already divided by their scale) to E2M1 codes (uint8 0..15).

    Round to nearest, ties to the even code (as hardware and ModelOpt do); saturates at +-6.
    """
    grid = torch.tensor(E2M1_GRID, device=x.device)
    mids = (grid[1:] + grid[:-1]) / 2  # (7,) decision boundaries
    a = x.abs().float()
    lo = torch.searchsorted(mids, a, right=False)  # a <= mids[lo]: ties go down here...
    hi = torch.searchsorted(mids, a, right=True)  # ...and up here; they differ only on a tie
    code = torch.where((lo != hi) & (lo % 2 == 1), hi, lo).to(torch.uint8)
    sign = (x < 0).to(torch.uint8) << 3
    return code | sign


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E2M1 codes (uint8 0..15) to values."""
    table = torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID), dtype=dtype, device=codes.device)
    return table[codes.long()]


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Round values to the nearest E2M1 value (ties to even code), keeping them as floats.

    Same result as e2m1_decode(e2m1_encode(x)) but several times faster, which matters because
    activations are fake-quantized on every forward. The E2M1 grid has step 0.5 below 2, 1 below
    4 and 2 up to 6, and torch.round rounds half to even, which is the even code on each segment.
    """
    a = x.abs().clamp(max=E2M1_MAX)
    q = torch.where(a < 2, torch.round(a * 2) / 2,
                    torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2))
    return torch.copysign(q, x)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] codes -> [..., n/2] bytes; the even element goes in the low nibble."""
    return (codes[..., 0::2] & 0x0F) | ((codes[..., 1::2] & 0x0F) << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., n/2] bytes -> [..., n] codes (inverse of pack_e2m1)."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)  # (..., n/2, 2) -> (..., n)


# --------------------------------------------------------------------------------------------
# NVFP4


@dataclass(frozen=True)
class NVFP4Weight:
    """One NVFP4-quantized weight as stored on disk."""

    packed: torch.Tensor  # uint8 [out, in/2]
    weight_scale: torch.Tensor  # float8_e4m3fn [out, in/16]
    weight_scale_2: torch.Tensor  # fp32 scalar

    def unscaled(self) -> torch.Tensor:
        """E2M1 value x E4M3 block scale, float32 [out, in]: the weight before weight_scale_2
        (at most 6 significant bits, in [2^-10, 2688]: exact in float16 as well)."""
        values = e2m1_decode(unpack_e2m1(self.packed))  # (out, in)
        blocks = values.reshape(*values.shape[:-1], -1, NVFP4_BLOCK_SIZE)  # (out, in/16, 16)
        return (blocks * self.weight_scale.float().unsqueeze(-1)).reshape(values.shape)


def _compute(x: torch.Tensor) -> torch.Tensor:
    """Quantization math runs in float32, or float64 when the model runs in float64."""
    return x if x.dtype == torch.float64 else x.float()


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """Per-tensor (second-level) scale from an absolute maximum: amax / (6 * 448)."""
    return torch.as_tensor(amax, dtype=torch.float32) / (E2M1_MAX * E4M3_MAX)


def _pad_to_block(x: torch.Tensor, block: int) -> torch.Tensor:
    pad = (-x.shape[-1]) % block
    return F.pad(x, (0, pad)) if pad else x


def _nvfp4_block_scales(blocks: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Per-16 block scales in float8_e4m3fn for blocks [..., nb, 16]."""
    block_amax = blocks.abs().amax(dim=-1).float()  # (..., nb)
    scale = block_amax / (E2M1_MAX * global_scale.float())
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # an all-zero block stays zero
    # Clamp into E4M3's range so tiny scales do not flush to 0 and large ones do not become NaN.
    return scale.clamp(min=2.0**-9, max=E4M3_MAX).to(torch.float8_e4m3fn)


def nvfp4_quantize(w: torch.Tensor, amax: torch.Tensor | float | None = None) -> NVFP4Weight:
    """Quantize a weight [out, in] to NVFP4; `amax` defaults to the weight's own absolute max."""
    if w.shape[-1] % NVFP4_BLOCK_SIZE:
        raise ValueError(f"NVFP4 needs in_features divisible by 16, got {tuple(w.shape)}")
    w = w.float()
    global_scale = nvfp4_global_scale(w.abs().amax() if amax is None else amax)
    blocks = w.reshape(*w.shape[:-1], -1, NVFP4_BLOCK_SIZE)  # (out, in/16, 16)
    scale = _nvfp4_block_scales(blocks, global_scale)  # (out, in/16) fp8
    scaled = blocks / (scale.float() * global_scale).unsqueeze(-1)  # (out, in/16, 16)
    codes = e2m1_encode(scaled.reshape(w.shape))  # (out, in)
    return NVFP4Weight(pack_e2m1(codes), scale, global_scale.reshape(()))


def nvfp4_dequantize(
    packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_scale_2: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """NVFP4 weight on disk -> dense [out, in] tensor."""
    values = e2m1_decode(unpack_e2m1(packed))  # (out, in)
    blocks = values.reshape(*values.shape[:-1], -1, NVFP4_BLOCK_SIZE)  # (out, in/16, 16)
    scale = weight_scale.float() * weight_scale_2.float()  # (out, in/16)
    return (blocks * scale.unsqueeze(-1)).reshape(values.shape).to(dtype)


def nvfp4_fake_quantize(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Round-trip x through NVFP4 with dynamic per-16 block scales along the last dim.

    This is what an NVFP4 GEMM does to its activations: the global scale (input_scale) is fixed
    at calibration, the block scales are computed from each block of 16 values at run time.
    """
    n = x.shape[-1]
    xp = _pad_to_block(_compute(x), NVFP4_BLOCK_SIZE)
    blocks = xp.reshape(*xp.shape[:-1], -1, NVFP4_BLOCK_SIZE)  # (..., nb, 16)
    gs = global_scale.to(device=x.device, dtype=xp.dtype)
    scale = _nvfp4_block_scales(blocks, gs).float() * gs  # (..., nb)
    out = e2m1_round(blocks / scale.unsqueeze(-1)) * scale.unsqueeze(-1)  # (..., nb, 16)
    return out.reshape(xp.shape)[..., :n].to(x.dtype)


# --------------------------------------------------------------------------------------------
# FP8 (E4M3, per tensor)


def fp8_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """Per-tensor FP8 scale: amax / 448."""
    return torch.as_tensor(amax, dtype=torch.float32) / E4M3_MAX


def fp8_quantize(w: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to float8_e4m3fn with a per-tensor scale (default: from the tensor's amax)."""
    scale = fp8_scale(w.abs().amax()) if scale is None else scale.float()
    q = (w.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.reshape(())


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """float8_e4m3fn tensor and its scale -> dense tensor."""
    return (q.float() * scale.float()).to(dtype)


def fp8_fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round-trip x through FP8 E4M3 with a fixed per-tensor scale (static activations)."""
    xc = _compute(x)
    s = scale.to(device=x.device, dtype=xc.dtype)
    return ((xc / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(xc.dtype) * s).to(x.dtype)


# --------------------------------------------------------------------------------------------
# INT4 (AWQ, weight only)


def int4_awq_dequantize(
    packed: torch.Tensor, weight_scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """W4A16_AWQ weight uint8 [out/2, in] (rows 2j, 2j+1 in the low, high nibble) -> [out, in]."""
    low = (packed & 0x0F).to(torch.int8)
    high = (packed >> 4).to(torch.int8)
    rows = torch.stack((low, high), dim=1).reshape(-1, packed.shape[-1])  # (out, in)
    rows = torch.where(rows >= 8, rows - 16, rows)  # two's complement nibbles
    group = rows.shape[-1] // weight_scale.shape[-1]
    scale = weight_scale.float().repeat_interleave(group, dim=-1)  # (out, in)
    return (rows.float() * scale).to(dtype)


# --------------------------------------------------------------------------------------------
# Running quantized layers


class QuantLinear(nn.Module):
    """A Linear whose weight was dequantized at load and whose input is quantized every call.

    `act_format` is "nvfp4" (dynamic per-16 blocks, `input_scale` as global scale), "fp8"
    (per tensor, static `input_scale`) or None (weight-only formats). `stored` keeps an NVFP4
    weight as stored, for kernels that read it so (dflash.cpu_fp16); not part of the state dict.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        act_format: str | None = None,
        input_scale: torch.Tensor | None = None,
        pre_quant_scale: torch.Tensor | None = None,
        stored: NVFP4Weight | None = None,
    ):
        super().__init__()
        if act_format is not None and input_scale is None:
            raise ValueError(f"{act_format} activations need an input_scale")
        self.out_features, self.in_features = weight.shape
        self.act_format = act_format
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.register_buffer("input_scale", None if input_scale is None else input_scale.float())
        self.register_buffer("pre_quant_scale", pre_quant_scale)
        self.stored = stored

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """The input as the quantized layer sees it (pre-quant scale, fake-quantized)."""
        if self.pre_quant_scale is not None:
            x = x * self.pre_quant_scale.to(x.dtype)
        if self.act_format == "nvfp4":
            x = nvfp4_fake_quantize(x, self.input_scale)
        elif self.act_format == "fp8":
            x = fp8_fake_quantize(x, self.input_scale)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.prepare_input(x), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, act={self.act_format}"


@dataclass(frozen=True)
class QuantConfig:
    """What hf_quant_config.json says, reduced to what loading and linting need."""

    quant_algo: str
    kv_cache_quant_algo: str | None
    group_size: int | None
    exclude_modules: tuple[str, ...]

    @property
    def act_format(self) -> str | None:
        return {NVFP4: "nvfp4", FP8: "fp8"}.get(self.quant_algo)


def read_quant_config(ckpt_dir: str | Path) -> QuantConfig | None:
    """Parse `hf_quant_config.json` in a checkpoint dir; None when the checkpoint is unquantized."""
    path = Path(ckpt_dir) / QUANT_CONFIG_FILE
    if not path.exists():
        return None
    q = json.loads(path.read_text()).get("quantization", {})
    return QuantConfig(
        quant_algo=str(q.get("quant_algo")),
        kv_cache_quant_algo=q.get("kv_cache_quant_algo"),
        group_size=q.get("group_size"),
        exclude_modules=tuple(q.get("exclude_modules") or ()),
    )


def is_quantized_checkpoint(ckpt_dir: str | Path) -> bool:
    """True when the dir holds a ModelOpt quantized checkpoint (hf_quant_config.json)."""
    return (Path(ckpt_dir) / QUANT_CONFIG_FILE).exists()


def load_safetensors_dir(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of every *.safetensors file in a dir (sharded or not)."""
    from safetensors.torch import load_file

    files = sorted(Path(ckpt_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {ckpt_dir}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def quantized_module_names(state: dict[str, torch.Tensor]) -> list[str]:
    """Modules whose weight is stored quantized (they carry a weight_scale)."""
    return sorted(k[: -len(".weight_scale")] for k in state if k.endswith(".weight_scale"))


def dequantize_weight(
    state: dict[str, torch.Tensor], name: str, algo: str, dtype: torch.dtype
) -> torch.Tensor:
    """Dense weight of module `name` from its stored quantized tensors."""
    w, s = state[f"{name}.weight"], state[f"{name}.weight_scale"]
    if algo in (NVFP4, W4A16_NVFP4):
        return nvfp4_dequantize(w, s, state[f"{name}.weight_scale_2"], dtype)
    if algo == FP8:
        return fp8_dequantize(w, s, dtype)
    if algo == W4A16_AWQ:
        return int4_awq_dequantize(w, s, dtype)
    raise ValueError(f"quant_algo {algo!r} is not supported (supported: {', '.join(SUPPORTED_ALGOS)})")


def build_quant_linears(
    state: dict[str, torch.Tensor], qcfg: QuantConfig, dtype: torch.dtype
) -> dict[str, QuantLinear]:
    """One QuantLinear per quantized module in a loaded checkpoint state dict."""
    layers = {}
    for name in quantized_module_names(state):
        scale = state.get(f"{name}.input_scale")
        pqs = state.get(f"{name}.pre_quant_scale")
        layers[name] = QuantLinear(
            dequantize_weight(state, name, qcfg.quant_algo, dtype),
            bias=None if f"{name}.bias" not in state else state[f"{name}.bias"].to(dtype),
            act_format=qcfg.act_format,
            input_scale=scale,
            pre_quant_scale=None if pqs is None else pqs.to(dtype),
            stored=NVFP4Weight(state[f"{name}.weight"], state[f"{name}.weight_scale"],
                               state[f"{name}.weight_scale_2"])
            if qcfg.quant_algo in (NVFP4, W4A16_NVFP4) and dtype == torch.float32 else None,
        )
    return layers


def swap_in_quant_linears(model: nn.Module, layers: dict[str, QuantLinear], prefix: str = "") -> None:
    """Replace model's submodules named in `layers` (minus `prefix`) by the QuantLinears."""
    for name, layer in layers.items():
        local = name[len(prefix) :] if prefix and name.startswith(prefix) else name
        parent_name, _, attr = local.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        if tuple(old.weight.shape) != tuple(layer.weight.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(layer.weight.shape)} != model {tuple(old.weight.shape)}")
        setattr(parent, attr, layer.to(old.weight.device))


def _quant_tensor_keys(name: str) -> list[str]:
    suffixes = ("weight", "bias", "weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale")
    return [f"{name}.{s}" for s in suffixes]


def plain_tensors(state: dict[str, torch.Tensor], quantized: list[str]) -> dict[str, torch.Tensor]:
    """The plain tensors: drop quantized layers' tensors and KV-cache scales (k_scale, v_scale)."""
    drop = {k for name in quantized for k in _quant_tensor_keys(name)}
    return {
        k: v for k, v in state.items() if k not in drop and not k.endswith((".k_scale", ".v_scale"))
    }
