"""What a tensorrt_llm deployment of a recipe needs on each GPU, estimated from the configs.

Weights: parameters counted from config.json (embeddings, attention with grouped KV heads, MLP,
MoE experts) at the recipe's format (nvfp4: 4-bit values plus one fp8 scale per 16; fp8: one
byte; embeddings and the LM head stay in the model dtype), the target split over
tensor_parallel_size. DFlash adds, per TensorRT-LLM's `_torch/speculative/dflash.py`:

- the drafter's context K/V, one slot per request plus one spare, each the whole max_seq_len plus
  a block: 2 x (max_batch_size + 1) x layers x (max_seq_len + max_draft_len + 1) x kv_heads x
  head_dim x 2 bytes. With VANILLA attention it is a plain allocation made after the KV cache
  pool is carved, so `free_gpu_memory_fraction` does not bound it; with TRTLLM attention it
  lives in the draft KV cache pool when that pool matches (then it is inside the fraction).
- the captured target hidden states: max_num_tokens x hidden x len(target_layer_ids) x 2 bytes.

The KV cache then takes `kv_cache_free_gpu_memory_fraction` of what is left. Estimates, not
measurements: TensorRT-LLM's own activations, CUDA graphs and workspace come on top.
"""

from __future__ import annotations

import json
from pathlib import Path

GIB = 2**30
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# bytes per quantized parameter: 4-bit values plus an fp8 scale per 16 (nvfp4) or an fp16 scale
# per 128 (int4_awq); fp8 one byte
_FORMAT_BYTES = {"nvfp4": 0.5 + 1 / 16, "w4a16_nvfp4": 0.5 + 1 / 16, "int4_awq": 0.5 + 2 / 128,
                 "fp8": 1.0}


def _text_config(config: dict) -> dict:
    return config.get("text_config") or config


def parameter_counts(config: dict) -> tuple[int, int]:
    """(parameters in quantizable Linears, parameters in embeddings and the LM head)."""
    c = _text_config(config)
    hidden, layers = c["hidden_size"], c["num_hidden_layers"]
    heads = c.get("num_attention_heads", 1)
    kv_heads = c.get("num_key_value_heads", heads)
    head_dim = c.get("head_dim") or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o and k, v projections
    mlp = 3 * hidden * c.get("intermediate_size", 4 * hidden)
    experts = c.get("num_local_experts") or c.get("num_experts") or 1
    if experts > 1:
        mlp = 3 * hidden * c.get("moe_intermediate_size", c.get("intermediate_size")) * experts
    vocab = c.get("vocab_size", 0)
    embeddings = vocab * hidden * (1 if c.get("tie_word_embeddings") else 2)
    return layers * (attention + mlp), embeddings


def gpu_memory_estimate(recipe, target_config: dict, drafter_config: dict) -> dict:
    """Bytes per GPU: target and drafter weights, the DFlash arena, the hidden-state capture."""
    from dflash_trt.stages.devices import engine_dtype

    engine, half = recipe.engine, _DTYPE_BYTES[engine_dtype(recipe)]
    linear, embed = parameter_counts(target_config)
    per_param = _FORMAT_BYTES.get(recipe.quantize.target.format, half)
    target = (linear * per_param + embed * half) / engine.tensor_parallel_size
    d_linear, _ = parameter_counts(drafter_config)  # embeddings and LM head shared with the target
    d = _text_config(drafter_config)
    heads = d.get("num_attention_heads", 1)
    kv_heads = d.get("num_key_value_heads", heads)
    head_dim = d.get("head_dim") or d["hidden_size"] // heads
    drafts = recipe.drafter.block_size - 1
    arena = (2 * (engine.max_batch_size + 1) * d["num_hidden_layers"]
             * (engine.max_seq_len + drafts + 1) * kv_heads * head_dim * half)
    captured = (engine.max_num_tokens * _text_config(target_config)["hidden_size"]
                * len((drafter_config.get("dflash_config") or {}).get("target_layer_ids") or [1])
                * half)
    vanilla = recipe.hardware not in ("sm100", "sm103")
    return {"target_weights": int(target), "drafter_weights": int(d_linear * half),
            "drafter_context": int(arena), "drafter_context_outside_kv_fraction": vanilla,
            "captured_hidden_states": int(captured)}


def read_configs(recipe) -> tuple[dict, dict] | None:
    """The target's and drafter's config.json from the resolve stage, or None before it ran."""
    resolved = Path(recipe.build_dir) / "resolved"
    try:
        return tuple(json.loads((resolved / m / "config.json").read_text())
                     for m in ("target", "drafter"))
    except (OSError, json.JSONDecodeError):
        return None


def memory_lines(recipe) -> list[str]:
    """`dflash-trt plan`'s memory section for a tensorrt_llm recipe."""
    configs = read_configs(recipe)
    if configs is None:
        return ["GPU memory: estimated once the resolve stage has the configs "
                "(`dflash-trt build RECIPE --only resolve`)"]
    m = gpu_memory_estimate(recipe, *configs)
    linear, embed = parameter_counts(configs[0])
    unquantized = (linear + embed) * _DTYPE_BYTES[recipe.target.dtype]
    where = ("outside kv_cache_free_gpu_memory_fraction (VANILLA attention)"
             if m["drafter_context_outside_kv_fraction"] else
             "inside the draft KV pool when it matches (TRTLLM attention)")
    fixed = m["target_weights"] + m["drafter_weights"] + m["captured_hidden_states"] + (
        m["drafter_context"] if m["drafter_context_outside_kv_fraction"] else 0)
    return [
        f"GPU memory per GPU (estimate, tensor_parallel_size "
        f"{recipe.engine.tensor_parallel_size}):",
        f"  target weights ({recipe.quantize.target.format})  {m['target_weights'] / GIB:7.2f} GiB",
        f"  drafter weights           {m['drafter_weights'] / GIB:7.2f} GiB",
        f"  drafter context K/V       {m['drafter_context'] / GIB:7.2f} GiB  {where}",
        f"  captured hidden states    {m['captured_hidden_states'] / GIB:7.2f} GiB",
        f"  before the KV cache       {fixed / GIB:7.2f} GiB; the KV cache then takes "
        f"{recipe.engine.kv_cache_free_gpu_memory_fraction:g} of what is free",
        f"Build stages on one GPU (no multi-GPU placement): quantize loads the target in "
        f"{recipe.target.dtype}, {unquantized / GIB:.1f} GiB; verify "
        f"{(2 if recipe.quantize.target.format != 'none' else 1) * unquantized / GIB:.1f} GiB "
        "(the quantized target, dequantized, beside the reference); each refuses a GPU where the "
        "weights take over 80%",
    ]
