"""The compile stage and the engine loader: engine.yaml, relative checkpoints, smoke generation."""

from __future__ import annotations

import os
import shutil

import pytest
import yaml
from quant_fixtures import make_recipe, stage_context, write_resolved

from dflash_trt.engines import load_engine
from dflash_trt.engines.base import SamplingParams, collect
from dflash_trt.engines.spec import EngineSpec
from dflash_trt.errors import DflashTrtError
from dflash_trt.stages.compile import run_compile_stage


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A tiny recipe with resolved + quantized (unquantized copies) checkpoints on disk."""
    root = tmp_path_factory.mktemp("compile")
    write_resolved(root / "tiny" / "resolved")
    shutil.copytree(root / "tiny" / "resolved", root / "tiny" / "quantized")
    return root, make_recipe(root, target_format="none", drafter_format="none")


def compile_to(recipe, name):
    ctx = stage_context(recipe, name)
    info = run_compile_stage(ctx)
    return ctx.out, info


def test_torch_engine_dir_is_self_contained_and_loads(built):
    root, recipe = built
    out, info = compile_to(recipe, "engine-a")
    data = yaml.safe_load((out / "engine.yaml").read_text())
    assert data["backend"] == "torch" and data["target"] == "target"
    assert data["drafter"] == "drafter" and data["device"] == "cpu"
    assert data["block_size"] == 4 and data["max_seq_len"] == 256
    assert data["defaults"]["max_tokens"] == recipe.triton.max_tokens
    assert data["prompt_lookup"] is recipe.engine.prompt_lookup is False
    assert data["prefix_cache_tokens"] == recipe.engine.prefix_cache_tokens == 4096
    assert info["smoke"]["tokens"] >= 1
    quantized = root / "tiny" / "quantized" / "target" / "model.safetensors"
    assert os.path.samefile(out / "target" / "model.safetensors", quantized)  # hard link

    moved = root / "moved" / "engine"  # relocatable: relative paths only
    shutil.copytree(out, moved)
    engine = load_engine(moved)
    assert engine.block_size == 4 and engine.max_seq_len == 256
    assert engine.prompt_lookup is False and engine.prefix_cache_tokens == 4096
    spec = yaml.safe_load((moved / "engine.yaml").read_text())
    spec.pop("prompt_lookup")  # engine.yaml from before the key existed still loads
    (moved / "engine.yaml").write_text(yaml.safe_dump({**spec, "prompt_lookup": True}))
    assert load_engine(moved).prompt_lookup is True
    (moved / "engine.yaml").write_text(yaml.safe_dump(spec))
    assert load_engine(moved).prompt_lookup is False
    ids = engine.tokenize("abc")
    result = collect(engine.stream(ids, SamplingParams(max_new_tokens=5)))
    assert len(result.token_ids) == 5


def test_prompt_lookup_goes_from_the_recipe_to_the_engine(built):
    _, recipe = built
    recipe = recipe.model_copy(update={"engine": recipe.engine.model_copy(
        update={"prompt_lookup": True})})
    out, _ = compile_to(recipe, "engine-lookup")
    assert yaml.safe_load((out / "engine.yaml").read_text())["prompt_lookup"] is True
    assert load_engine(out).prompt_lookup is True


def test_adaptive_draft_length_ships_the_cost_model_measured_at_build(built):
    from dflash_trt.engines.cost_model import COST_MODEL_FILE, CostModel

    root, recipe = built
    assert recipe.engine.draft_length == "adaptive"  # the default
    out, _ = compile_to(recipe, "engine-adaptive")
    assert yaml.safe_load((out / "engine.yaml").read_text())["draft_length"] == "adaptive"
    stored = CostModel.read(out)
    assert stored is not None and len(stored.costs.verify_s) == 4
    assert load_engine(out).cost_model == stored  # same device kind: the stored one is used

    fixed = recipe.model_copy(update={"engine": recipe.engine.model_copy(
        update={"draft_length": "fixed"})})
    out, _ = compile_to(fixed, "engine-fixed")
    assert not (out / COST_MODEL_FILE).exists() and load_engine(out).cost_model is None


def test_the_build_measures_a_batching_engines_cost_model_on_its_own_thread(built, monkeypatch):
    """The build's thread owns an OpenMP team from quantize and verify; measuring on a second
    thread with a team of its own put the process over its cores and inflated every forward
    (33.5 ms against 21 ms served, one token, the CPU default). A server's loader thread still
    measures apart."""
    import threading

    from dflash_trt.engines import cost_model

    threads = []
    real = cost_model.measure

    def spy(engine, **kwargs):
        threads.append(threading.current_thread())
        return real(engine, **kwargs)

    monkeypatch.setattr(cost_model, "measure", spy)
    root, recipe = built
    batching = recipe.model_copy(update={"engine": recipe.engine.model_copy(
        update={"max_batch_size": 2})})
    out, _ = compile_to(batching, "engine-batching")
    assert threads == [threading.current_thread()]

    (out / cost_model.COST_MODEL_FILE).unlink()
    engine = load_engine(out)  # as the Triton model loads it
    try:
        assert len(threads) == 2 and threads[1] is not threading.current_thread()
        assert engine.cost_model is not None
    finally:
        engine.close()


def test_adaptive_engines_carry_the_verify_calibration(built):
    import json

    from dflash_trt.engines.cost_model import CALIBRATION_FILE

    root, recipe = built
    reports = recipe.build_dir / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    profile = {"drafter_steps": 60, "calibration": [
        {"mean_confidence": 0.95, "rate": 0.5, "drafts": 40},
        {"mean_confidence": 0.35, "rate": 0.1, "drafts": 30},
        {"mean_confidence": 0.55, "rate": 0.9, "drafts": 3}]}  # too few drafts: left out
    (reports / "verify.json").write_text(json.dumps({"acceptance_profile": profile}))
    try:
        out, info = compile_to(recipe, "engine-calibrated")
    finally:
        shutil.rmtree(reports)
    assert info["acceptance_calibration"] == 2
    stored = json.loads((out / CALIBRATION_FILE).read_text())
    assert stored["points"] == [[0.95, 0.5], [0.35, 0.1]]
    engine = load_engine(out)
    assert engine.acceptance(0.95) == 0.5 and engine.acceptance(0.65) == pytest.approx(0.3)
    assert load_engine(compile_to(recipe, "engine-uncalibrated")[0]).acceptance is None


def test_trtllm_build_path_is_refused_with_the_reason(built):
    _, recipe = built
    engine = recipe.engine.model_copy(update={"build_path": "trtllm_build"})
    with pytest.raises(DflashTrtError, match="removed its trtllm-build"):
        compile_to(recipe.model_copy(update={"engine": engine}), "engine-b")


def test_max_tokens_must_fit_max_seq_len(built):
    _, recipe = built
    triton = recipe.triton.model_copy(update={"max_tokens": 256})
    with pytest.raises(DflashTrtError, match="triton.max_tokens"):
        compile_to(recipe.model_copy(update={"triton": triton}), "engine-c")


def test_tensorrt_llm_writes_options_without_loading(built):
    _, recipe = built
    gpu = recipe.model_copy(update={
        "hardware": "sm100",
        "engine": recipe.engine.model_copy(update={"backend": "tensorrt_llm", "device": "auto"})})
    out, info = compile_to(gpu, "engine-d")
    spec = EngineSpec.read(out)
    assert spec.backend == "tensorrt_llm" and spec.device == "cuda"
    options = yaml.safe_load((out / "llm_api_options.yaml").read_text())
    assert options["speculative_config"]["decoding_type"] == "DFlash"
    assert options["speculative_config"]["max_draft_len"] == 3
    assert options["speculative_config"]["speculative_model"] == "drafter"  # relative
    assert "smoke" not in info


def test_loader_refuses_paths_outside_the_engine_tree(tmp_path):
    engine = tmp_path / "a" / "engine"
    engine.mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    EngineSpec(backend="torch", target="../../outside", drafter=None, dtype="float32",
               device="cpu", block_size=1, max_batch_size=1, max_seq_len=64,
               chat_template=False).write(engine)
    with pytest.raises(DflashTrtError, match="outside"):
        load_engine(engine)


def test_engine_yaml_with_unknown_keys_is_refused(tmp_path):
    (tmp_path / "engine.yaml").write_text("backend: torch\ntarget: t\nbogus: 1\n")
    with pytest.raises(DflashTrtError, match="bogus"):
        EngineSpec.read(tmp_path)
    with pytest.raises(DflashTrtError, match="missing"):
        EngineSpec.read(tmp_path / "nowhere")


def test_the_fleet_schedule_reads_the_full_vocabulary_profile(tmp_path):
    import json

    from dflash_trt.stages.compile import _position_rates

    def profile(rate):
        return {"drafter_steps": 9, "position_acceptance": [{"position": 1, "rate": rate}]}

    assert _position_rates(tmp_path) is None
    (tmp_path / "verify.json").write_text(json.dumps({"acceptance_profile": profile(0.6)}))
    assert _position_rates(tmp_path) == [0.6]
    (tmp_path / "verify.json").write_text(json.dumps(
        {"acceptance_profile": profile(0.6), "full_vocab_acceptance_profile": profile(0.2)}))
    assert _position_rates(tmp_path) == [0.2]  # as TensorRT-LLM drafts
