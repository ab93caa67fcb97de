"""llm_api_options: the TensorRT-LLM LLM API options written for a DFlash engine.

Runs without tensorrt_llm: the option names are checked against the list shipped in
dflash_trt/engines/trtllm_llm_api_options.yaml (taken from a named TensorRT-LLM version).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dflash_trt.engines.trtllm_options import (
    LLM_API_OPTIONS_FILE,
    check_option_names,
    llm_api_options,
    load_option_names,
    read_drafter_config,
    read_llm_api_options,
    resolve_option_paths,
    write_llm_api_options,
)
from dflash_trt.errors import DflashTrtError
from dflash_trt.recipe import load_recipe

RECIPES = Path(__file__).resolve().parents[3] / "recipes"
QWEN_LAYERS = [1, 9, 17, 25, 33]  # build_target_layer_ids(36, 5), as in z-lab/Qwen3-8B-DFlash-b16


def _checkpoints(tmp_path: Path, *, layers: int = 36, block_size: int | None = 16,
                 dflash: dict | None = None) -> tuple[Path, Path]:
    """Tiny stand-ins with the config shapes of a target and a DFlash drafter (no weights)."""
    target = tmp_path / "quantized" / "target"
    drafter = tmp_path / "quantized" / "drafter"
    target.mkdir(parents=True)
    drafter.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
    config: dict = {"architectures": ["DFlashDraftModel"], "num_target_layers": layers,
                    "num_hidden_layers": 5}
    if block_size is not None:
        config["block_size"] = block_size
    config["dflash_config"] = (
        dflash if dflash is not None else {"mask_token_id": 151669, "target_layer_ids": QWEN_LAYERS}
    )
    (drafter / "config.json").write_text(json.dumps(config))
    return target, drafter


def test_b200_recipe_options_exactly(tmp_path):
    recipe = load_recipe(RECIPES / "qwen3-8b-nvfp4-b200.yaml")
    target, drafter = _checkpoints(tmp_path)
    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()
    options = llm_api_options(recipe, target, drafter, engine_dir=engine_dir)
    assert options == {
        "speculative_config": {
            "decoding_type": "DFlash",
            "max_draft_len": 15,
            "speculative_model": "../quantized/drafter",
            "mask_token_id": 151669,
            "target_layer_ids": QWEN_LAYERS,
            "attention_backend": "TRTLLM",
        },
        "kv_cache_config": {"free_gpu_memory_fraction": 0.85, "enable_block_reuse": False,
                            "dtype": "fp8"},
        "cuda_graph_config": {"enable_padding": True, "max_batch_size": 32},
        "disable_overlap_scheduler": False,
        "enable_chunked_prefill": False,
        "max_batch_size": 32,
        "max_num_tokens": 8192,
        "max_seq_len": 8192,
        "tensor_parallel_size": 1,
        "dtype": "bfloat16",
    }


def test_hopper_recipe_uses_vanilla_attention(tmp_path):
    recipe = load_recipe(RECIPES / "llama3.1-8b-fp8-h200.yaml")
    target, drafter = _checkpoints(tmp_path, layers=32,
                                   dflash={"mask_token_id": 128002, "target_layer_ids": [1, 8]})
    spec = llm_api_options(recipe, target, drafter)["speculative_config"]
    assert spec["attention_backend"] == "VANILLA"
    assert spec["speculative_model"] == str(drafter)  # no engine_dir: the path as given


def test_gpt_oss_recipe_block_10_and_tensor_parallel_4(tmp_path):
    recipe = load_recipe(RECIPES / "gpt-oss-120b-nvfp4-gb200.yaml")
    target, drafter = _checkpoints(tmp_path, block_size=10)
    options = llm_api_options(recipe, target, drafter)
    assert options["speculative_config"]["max_draft_len"] == 9
    assert options["tensor_parallel_size"] == 4


def test_kv_cache_none_leaves_dtype_to_the_checkpoint(tmp_path):
    recipe = load_recipe(RECIPES / "qwen3-8b-nvfp4-b200.yaml")
    recipe = recipe.model_copy(update={"quantize": recipe.quantize.model_copy(
        update={"target": recipe.quantize.target.model_copy(update={"kv_cache": "none"})})})
    target, drafter = _checkpoints(tmp_path)
    assert "dtype" not in llm_api_options(recipe, target, drafter)["kv_cache_config"]


def _with(recipe, **sections):
    """A copy with some sections replaced, bypassing validation (to test our own guards)."""
    return recipe.model_copy(update=sections)


def test_refuses_removed_trtllm_build_path(tmp_path):
    recipe = load_recipe(RECIPES / "qwen3-8b-nvfp4-b200.yaml")
    recipe = _with(recipe, engine=recipe.engine.model_copy(update={"build_path": "trtllm_build"}))
    target, drafter = _checkpoints(tmp_path)
    with pytest.raises(DflashTrtError, match="removed its TensorRT engine-build path"):
        llm_api_options(recipe, target, drafter)


def test_refuses_nvfp4_on_hopper_suggesting_fp8(tmp_path):
    recipe = _with(load_recipe(RECIPES / "qwen3-8b-nvfp4-b200.yaml"), hardware="sm90")
    target, drafter = _checkpoints(tmp_path)
    with pytest.raises(DflashTrtError, match=r"quantize\.target\.format: nvfp4.*fp8"):
        llm_api_options(recipe, target, drafter)


def test_refuses_cpu_hardware(tmp_path):
    recipe = _with(load_recipe(RECIPES / "llama3.1-8b-fp8-h200.yaml"), hardware="cpu")
    target, drafter = _checkpoints(tmp_path)
    with pytest.raises(DflashTrtError, match="needs an NVIDIA GPU"):
        llm_api_options(recipe, target, drafter)


def test_drafter_block_size_must_match_recipe(tmp_path):
    recipe = load_recipe(RECIPES / "qwen3-8b-nvfp4-b200.yaml")
    target, drafter = _checkpoints(tmp_path, block_size=8)
    with pytest.raises(DflashTrtError, match="drafter.block_size: 8"):
        llm_api_options(recipe, target, drafter)


def test_target_layer_ids_must_exist_in_the_target(tmp_path):
    recipe = load_recipe(RECIPES / "qwen3-8b-nvfp4-b200.yaml")
    target, drafter = _checkpoints(tmp_path, layers=28)  # 33 is out of range
    with pytest.raises(DflashTrtError, match=r"\[33\] are outside the target's 28 layers"):
        llm_api_options(recipe, target, drafter)


@pytest.mark.parametrize("dflash, message", [
    ({"target_layer_ids": [1]}, "mask_token_id must be an integer"),
    ({"mask_token_id": 5, "target_layer_ids": []}, "non-empty list"),
    ({"mask_token_id": True, "target_layer_ids": [1]}, "mask_token_id must be an integer"),
])
def test_bad_drafter_config(tmp_path, dflash, message):
    _, drafter = _checkpoints(tmp_path, dflash=dflash)
    with pytest.raises(DflashTrtError, match=message):
        read_drafter_config(drafter)


def test_missing_drafter_config_says_what_to_do(tmp_path):
    with pytest.raises(DflashTrtError, match="drafter checkpoint is missing"):
        read_drafter_config(tmp_path)


@pytest.mark.parametrize("options, bad", [
    ({"max_batch_sizes": 4}, "`max_batch_sizes`"),
    ({"speculative_config": {"decoding_type": "DFlash", "max_draft": 3}},
     "`speculative_config.max_draft`"),
    ({"kv_cache_config": {"free_gpu_mem_fraction": 0.5}},
     "`kv_cache_config.free_gpu_mem_fraction`"),
    ({"speculative_config": {"decoding_type": "Eagle3"}}, "decoding_type: Eagle3"),
    ({"speculative_config": {"attention_backend": "FLASHINFER"}}, "attention_backend: FLASHINFER"),
    ({"kv_cache_config": {"dtype": "int8"}}, "dtype: int8"),
])
def test_unknown_option_names_and_values_fail(options, bad):
    with pytest.raises(DflashTrtError, match="unknown TensorRT-LLM LLM API option") as err:
        check_option_names(options)
    assert bad in str(err.value)


def test_options_list_names_its_source_version():
    names = load_option_names()
    assert "tensorrt_llm/llmapi/llm_args.py" in names.source
    assert names.tensorrt_llm_version in names.container
    # The keys the DFlash docs show for --config must all be accepted.
    assert {"decoding_type", "max_draft_len", "speculative_model", "mask_token_id",
            "target_layer_ids", "attention_backend"} <= names.speculative_config


def test_relative_paths_resolve_against_the_engine_dir(tmp_path):
    options = {"speculative_config": {"decoding_type": "DFlash", "max_draft_len": 3,
                                      "speculative_model": "../quantized/drafter"}}
    resolved = resolve_option_paths(options, tmp_path / "engine")
    assert resolved["speculative_config"]["speculative_model"] == str(
        (tmp_path / "quantized" / "drafter").resolve())
    assert options["speculative_config"]["speculative_model"] == "../quantized/drafter"


def test_write_then_read_round_trips(tmp_path):
    recipe = load_recipe(RECIPES / "qwen3-8b-nvfp4-b200.yaml")
    target, drafter = _checkpoints(tmp_path)
    options = llm_api_options(recipe, target, drafter, engine_dir=tmp_path)
    path = write_llm_api_options(options, tmp_path)
    assert path.name == LLM_API_OPTIONS_FILE
    assert yaml.safe_load(path.read_text()) == options
    assert read_llm_api_options(tmp_path) == options


def test_read_rejects_a_hand_edited_unknown_option(tmp_path):
    (tmp_path / LLM_API_OPTIONS_FILE).write_text("max_batch_size: 4\nmax_tokens_in_flight: 9\n")
    with pytest.raises(DflashTrtError, match="max_tokens_in_flight"):
        read_llm_api_options(tmp_path)


def _schedule_ok(schedule: dict, max_draft_len: int, max_batch_size: int) -> None:
    """TensorRT-LLM's rules (DecodingBaseConfig.validate_draft_len_schedule_and_sort) and ours:
    the smallest key drafts max_draft_len, no value above it, non-increasing, and a key for the
    largest batch (above the largest key upstream drafts nothing)."""
    keys = sorted(schedule)
    assert keys[0] == 1 and schedule[1] == max_draft_len
    assert all(0 <= schedule[k] <= max_draft_len for k in keys)
    assert [schedule[k] for k in keys] == sorted(schedule.values(), reverse=True)
    assert keys[-1] == max_batch_size


def test_schedule_from_the_acceptance_profile_drafts_less_as_the_batch_grows(tmp_path):
    recipe = load_recipe(RECIPES / "qwen3-8b-nvfp4-b200.yaml")
    target, drafter = _checkpoints(tmp_path)
    rates = [0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1]  # positions 9..15: never reached, 0
    spec = llm_api_options(recipe, target, drafter, position_rates=rates)["speculative_config"]
    schedule = spec["draft_len_schedule"]
    _schedule_ok(schedule, 15, 32)
    assert schedule[32] < schedule[2] < 15  # saturated at 32 x (k + 1) tokens: fewer drafts
    check_option_names({"speculative_config": spec})


def test_a_drafter_that_never_passes_drafts_only_at_batch_1(tmp_path):
    recipe = load_recipe(RECIPES / "qwen3-8b-nvfp4-b200.yaml")
    target, drafter = _checkpoints(tmp_path)
    spec = llm_api_options(recipe, target, drafter, position_rates=[0.0] * 15)
    schedule = spec["speculative_config"]["draft_len_schedule"]
    assert schedule == {1: 15, 2: 0, 4: 0, 8: 0, 16: 0, 32: 0}


def test_the_recipe_schedule_wins_and_no_profile_means_a_fixed_length(tmp_path):
    data = yaml.safe_load((RECIPES / "qwen3-8b-nvfp4-b200.yaml").read_text())
    data["engine"]["draft_len_schedule"] = {1: 15, 8: 4, 32: 1}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    target, drafter = _checkpoints(tmp_path)
    spec = llm_api_options(load_recipe(path), target, drafter, position_rates=[0.0])
    assert spec["speculative_config"]["draft_len_schedule"] == {1: 15, 8: 4, 32: 1}
    fixed = llm_api_options(load_recipe(RECIPES / "qwen3-8b-nvfp4-b200.yaml"), target, drafter)
    assert "draft_len_schedule" not in fixed["speculative_config"]


def test_rejection_sampling_overlap_and_chunked_prefill_follow_the_recipe(tmp_path):
    data = yaml.safe_load((RECIPES / "qwen3-8b-nvfp4-b200.yaml").read_text())
    data["engine"].update(rejection_sampling=True, overlap_scheduler=False, chunked_prefill=True)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    target, drafter = _checkpoints(tmp_path)
    options = llm_api_options(load_recipe(path), target, drafter)
    assert options["speculative_config"]["use_rejection_sampling"] is True
    assert options["disable_overlap_scheduler"] is True and options["enable_chunked_prefill"]
