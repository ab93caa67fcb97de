"""The GPU memory estimate `plan` prints for tensorrt_llm recipes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_trt.recipe import load_recipe
from dflash_trt.stages.memory import GIB, gpu_memory_estimate, memory_lines, parameter_counts

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
LLAMA_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336,
            "vocab_size": 128256, "tie_word_embeddings": False}
DRAFTER = {**LLAMA_8B, "num_hidden_layers": 5,
           "dflash_config": {"mask_token_id": 128002, "target_layer_ids": [1, 8, 15, 22, 29]}}


def test_llama_8b_has_8_billion_parameters():
    linear, embeddings = parameter_counts(LLAMA_8B)
    assert (linear + embeddings) / 1e9 == pytest.approx(8.03, abs=0.01)


def test_the_llama_recipe_arena_is_about_5_gib_outside_the_kv_fraction():
    recipe = load_recipe(RECIPES / "llama3.1-8b-fp8-h200.yaml")
    m = gpu_memory_estimate(recipe, LLAMA_8B, DRAFTER)
    # 2 (K, V) x 33 slots x 5 layers x (8192 + 15 + 1) positions x 8 heads x 128 x 2 bytes
    assert m["drafter_context"] == 2 * 33 * 5 * 8208 * 8 * 128 * 2
    assert m["drafter_context"] / GIB == pytest.approx(5.17, abs=0.01)
    assert m["drafter_context_outside_kv_fraction"]  # sm90: VANILLA attention
    assert m["target_weights"] / GIB == pytest.approx(8.46, abs=0.05)  # fp8 Linears, bf16 embeddings
    assert m["captured_hidden_states"] == 8192 * 4096 * 5 * 2


def test_plan_prints_the_estimate_after_resolve(tmp_path):
    recipe = load_recipe(RECIPES / "llama3.1-8b-fp8-h200.yaml").model_copy(
        update={"output_dir": str(tmp_path)})
    assert "once the resolve stage" in memory_lines(recipe)[0]
    for name, config in (("target", LLAMA_8B), ("drafter", DRAFTER)):
        (recipe.build_dir / "resolved" / name).mkdir(parents=True)
        (recipe.build_dir / "resolved" / name / "config.json").write_text(json.dumps(config))
    text = "\n".join(memory_lines(recipe))
    assert "drafter context K/V          5.17 GiB  outside kv_cache_free_gpu_memory_fraction" in text
    assert "quantize loads the target in bfloat16, 15.0 GiB; verify 29.9 GiB" in text
