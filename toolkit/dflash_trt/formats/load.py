"""Loading a target or drafter checkpoint, plain or ModelOpt-quantized, in one call each.

A quantized checkpoint (hf_quant_config.json) loads as a model that computes what it computes:
quantized Linears become `qformats.QuantLinear` (weights dequantized once, activations
fake-quantized per the format). KV-cache scales are read but not applied: the torch engine keeps
its KV cache in the model dtype. No modelopt import.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_trt.dflash.attention import implementation_for
from dflash_trt.errors import DflashTrtError, UsageError

# float64 exists for exactness checks: with fake-quantized activations, float32 rounding that
# depends on the matmul shape (1-token decode vs k-token verify) can flip a quantization step.
DTYPES = ("float32", "bfloat16", "float16", "float64")


def torch_dtype(name):
    """The torch dtype for a name in DTYPES (a torch.dtype passes through)."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise UsageError(f"dtype {name!r} is not supported; choose one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def load_target(target_dir: Path, *, dtype: str = "float32", device: str = "cpu"):
    """The target causal LM in eval mode on `device`: a plain HF checkpoint or a quantized one."""
    import torch
    from transformers import AutoModelForCausalLM

    target_dir = Path(target_dir)
    if (target_dir / "hf_quant_config.json").is_file():
        return _load_quantized_target(target_dir, torch_dtype(dtype), device)
    if not (target_dir / "config.json").is_file():
        raise DflashTrtError(f"{target_dir}: no config.json; expected a resolved target checkpoint")
    from transformers import AutoConfig

    dtype = torch_dtype(dtype)
    attention = implementation_for(dtype, AutoConfig.from_pretrained(target_dir), device)
    with torch.device(device):
        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype,
                                                     attn_implementation=attention)
    return model.to(device).eval()


def load_drafter(drafter_dir: Path, *, dtype: str = "float32", device: str = "cpu"):
    """The DFlash drafter; a quantized one has its weights dequantized and its activations
    fake-quantized like the target's."""
    from dflash_trt.dflash.drafter import DFlashDraftModel
    from dflash_trt.formats import qformats as qf

    drafter_dir = Path(drafter_dir)
    config_file = drafter_dir / "config.json"
    qcfg = None
    if config_file.is_file() and "quantization_config" in json.loads(config_file.read_text()):
        qcfg = qf.read_quant_config(drafter_dir)
    if qcfg is None:
        return DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch_dtype(dtype), device=device)
    # Dense weights first (keys as in the plain format), then the quantized Linears swapped in.
    state = qf.load_safetensors_dir(drafter_dir)
    quantized = qf.quantized_module_names(state)
    float32 = torch_dtype("float32")
    dense = {k: v.to(float32) for k, v in qf.plain_tensors(state, quantized).items()}
    for name in quantized:
        dense[f"{name}.weight"] = qf.dequantize_weight(state, name, qcfg.quant_algo, float32)
    model = DFlashDraftModel.from_pretrained(drafter_dir, state_dict=dense,
                                             dtype=torch_dtype(dtype), device=device)
    param = next(model.parameters())
    qf.swap_in_quant_linears(model, qf.build_quant_linears(state, qcfg, param.dtype))
    return model


def _load_quantized_target(target_dir: Path, dtype, device: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_trt.formats import qformats as qf

    qcfg = qf.read_quant_config(target_dir)
    config = AutoConfig.from_pretrained(target_dir)
    if hasattr(config, "quantization_config"):
        # The modelopt quantization_config would make transformers look for its own quantizer.
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                             attn_implementation=implementation_for(dtype, config,
                                                                                   device))
    state = qf.load_safetensors_dir(target_dir)
    layers = qf.build_quant_linears(state, qcfg, dtype)
    qf.swap_in_quant_linears(model, layers)
    plain = {k: v.to(dtype) if v.is_floating_point() else v
             for k, v in qf.plain_tensors(state, list(layers)).items()}
    missing, unexpected = model.load_state_dict(plain, strict=False)
    quant_keys = {f"{n}.{s}" for n in layers for s in ("weight", "bias", "input_scale",
                                                        "pre_quant_scale")}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [k for k in missing if k not in quant_keys and not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise DflashTrtError(f"{target_dir}: missing tensors {missing[:5]}, unexpected "
                             f"{unexpected[:5]}; re-run the quantize stage")
    if tied:
        model.tie_weights()
    return model.to(device).eval()
