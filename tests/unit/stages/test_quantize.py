"""ModelOpt quantization and export of tiny models (NVFP4, FP8), calibration data, the stage."""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("modelopt.torch.quantization")

from dflash_fixtures import tiny_target  # noqa: E402
from quant_fixtures import char_tokenizer, make_recipe, stage_context, write_resolved  # noqa: E402

from dflash_trt.errors import UsageError  # noqa: E402
from dflash_trt.formats import qformats as qf  # noqa: E402
from dflash_trt.formats.lint import lint_checkpoint  # noqa: E402
from dflash_trt.formats.load import load_drafter, load_target  # noqa: E402
from dflash_trt.stages.quantize import (  # noqa: E402
    CalibrationData,
    build_calibration,
    export_target,
    mtq_config,
    quantize_target,
    run_quantize_stage,
)

CPU = torch.device("cpu")
PROJ = [f"model.layers.{i}.{p}" for i in range(4) for p in (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


def calib_ids(seed: int = 0) -> CalibrationData:
    return CalibrationData(torch.randint(0, 127, (4, 32), generator=torch.Generator().manual_seed(seed)),
                           "test", ())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """NVFP4 and FP8 exports of the same tiny model, plus its original weights and fake-quant logits."""
    root = tmp_path_factory.mktemp("export")
    src = root / "src"
    char_tokenizer().save_pretrained(src)
    ref = tiny_target("llama", seed=0)
    ref.config.architectures = ["LlamaForCausalLM"]
    x = torch.randint(0, 127, (2, 16), generator=torch.Generator().manual_seed(5))
    out = {"ref": ref, "x": x}
    for fmt in ("nvfp4", "fp8"):
        model = copy.deepcopy(ref)
        quantize_target(model, fmt, "none", calib_ids(), 2, CPU)
        with torch.no_grad():
            out[f"{fmt}_logits"] = model(x).logits
            out[f"{fmt}_o_proj"] = model.model.layers[1].self_attn.o_proj(torch.randn(3, 64, generator=torch.Generator().manual_seed(6)))
        export_target(model, src, root / fmt, torch.float32)
        out[fmt] = root / fmt
    return out


def tensors(path):
    return qf.load_safetensors_dir(path)


def test_nvfp4_export_layout(exported):
    state = tensors(exported["nvfp4"])
    qcfg = json.loads((exported["nvfp4"] / "hf_quant_config.json").read_text())["quantization"]
    assert qcfg["quant_algo"] == "NVFP4" and qcfg["group_size"] == 16
    assert "model.embed_tokens" in qcfg["exclude_modules"]
    for name in PROJ:
        w, s = state[f"{name}.weight"], state[f"{name}.weight_scale"]
        out_f, in_f = exported["ref"].get_submodule(name).weight.shape
        assert w.dtype == torch.uint8 and w.shape == (out_f, in_f // 2)
        assert s.dtype == torch.float8_e4m3fn and s.shape == (out_f, in_f // 16)
        assert state[f"{name}.weight_scale_2"].shape == () and state[f"{name}.input_scale"].shape == ()
    assert state["model.embed_tokens.weight"].dtype == torch.float32
    assert (exported["nvfp4"] / "tokenizer.json").exists()
    assert lint_checkpoint(exported["nvfp4"]) == []


def test_nvfp4_dequantized_weights_are_close(exported):
    state = tensors(exported["nvfp4"])
    for name in PROJ:
        w = exported["ref"].get_submodule(name).weight.detach()
        deq = qf.dequantize_weight(state, name, "NVFP4", torch.float32)
        assert 0.01 < float((deq - w).norm() / w.norm()) < 0.15, name


def test_fp8_export_layout_and_error(exported):
    state = tensors(exported["fp8"])
    for name in PROJ:
        w = exported["ref"].get_submodule(name).weight.detach()
        assert state[f"{name}.weight"].dtype == torch.float8_e4m3fn
        assert state[f"{name}.weight"].shape == w.shape
        assert state[f"{name}.weight_scale"].shape == () and state[f"{name}.input_scale"].shape == ()
        deq = qf.dequantize_weight(state, name, "FP8", torch.float32)
        assert float((deq - w).norm() / w.norm()) < 0.05
    assert lint_checkpoint(exported["fp8"]) == []


def test_loaded_fp8_model_computes_what_modelopt_computed(exported):
    model = load_target(exported["fp8"], dtype="float32", device="cpu")
    assert isinstance(model.model.layers[0].mlp.up_proj, qf.QuantLinear)
    with torch.no_grad():
        logits = model(exported["x"]).logits
    torch.testing.assert_close(logits, exported["fp8_logits"], rtol=1e-4, atol=1e-4)


def test_loaded_nvfp4_layer_computes_what_modelopt_computed(exported):
    # o_proj is in no fused group, so export keeps its own scales: the layer must match exactly.
    model = load_target(exported["nvfp4"], dtype="float32", device="cpu")
    layer = model.model.layers[1].self_attn.o_proj
    assert isinstance(layer, qf.QuantLinear) and layer.act_format == "nvfp4"
    with torch.no_grad():
        y = layer(torch.randn(3, 64, generator=torch.Generator().manual_seed(6)))
    torch.testing.assert_close(y, exported["nvfp4_o_proj"], rtol=1e-5, atol=1e-5)


def test_calibration_is_deterministic_and_hashed():
    tok = char_tokenizer()
    a = build_calibration(tok, ["builtin:python-stdlib", "builtin:chat"], 4, 32)
    b = build_calibration(tok, ["builtin:python-stdlib", "builtin:chat"], 4, 32)
    assert a.input_ids.shape == (4, 32) and a.sha256 == b.sha256
    c = build_calibration(tok, ["builtin:python-stdlib"], 4, 32)
    assert c.sha256 != a.sha256
    with pytest.raises(UsageError, match="fewer than one sequence"):
        build_calibration(tok, ["builtin:chat"], 4, 100_000)


def test_calibration_reads_every_data_set_a_recipe_accepts(tmp_path):
    from dflash_trt.recipe import BUILTIN_DATA

    tok = char_tokenizer()
    for spec in BUILTIN_DATA:
        assert build_calibration(tok, [spec], 2, 16).num_sequences == 2, spec
    rows = tmp_path / "pairs.jsonl"
    rows.write_text('{"prompt": "add two numbers", "response": "def add(a, b): return a + b"}\n')
    calib = build_calibration(tok, [str(rows)], 1, 22)  # one character per token
    assert tok.decode(calib.input_ids[0].tolist()) == "add two numbersdef add"
    with pytest.raises(UsageError, match="quantize.calibration.data: .*missing.txt does not exist"):
        build_calibration(tok, [str(tmp_path / "missing.txt")], 1, 16)


def test_mtq_config_adds_kv_cache_quantizers():
    cfg = mtq_config("fp8", "fp8")
    names = [e.get("quantizer_name") for e in cfg["quant_cfg"]] if isinstance(cfg["quant_cfg"], list) \
        else list(cfg["quant_cfg"])
    assert "*[kv]_bmm_quantizer" in names
    assert "*[kv]_bmm_quantizer" not in str(mtq_config("fp8", "none"))


def test_quantize_stage_writes_linted_nvfp4_target_and_drafter(tmp_path):
    from dflash_trt.dflash.drafter import DFlashDraftModel

    write_resolved(tmp_path / "tiny" / "resolved")
    (tmp_path / "tiny" / "resolved" / "drafter" / "draft_vocab.json").write_text('{"token_ids": [3, 4]}')
    ctx = stage_context(make_recipe(tmp_path), "quantized")
    info = run_quantize_stage(ctx)
    assert info["calibration"]["num_sequences"] == 4 and len(info["calibration"]["sha256"]) == 64
    drafter_dir = ctx.out / "drafter"
    assert (drafter_dir / "draft_vocab.json").read_text() == '{"token_ids": [3, 4]}'  # kept
    assert qf.read_quant_config(drafter_dir).quant_algo == "NVFP4"
    assert tensors(drafter_dir)["fc.weight"].dtype == torch.uint8
    drafter = load_drafter(drafter_dir)
    assert isinstance(drafter.fc, qf.QuantLinear) and drafter.fc.act_format == "nvfp4"
    plain = DFlashDraftModel.from_pretrained(ctx.stage_dir("resolve") / "drafter")
    noise, feats = torch.randn(1, 4, 64), torch.randn(1, 6, 128)
    with torch.no_grad():
        a, b = drafter(noise, feats), plain(noise, feats)
    assert 0 < float((a - b).norm() / b.norm()) < 0.2


def test_quantize_stage_none_copies_and_rejects_drafter_kv(tmp_path):
    write_resolved(tmp_path / "tiny" / "resolved")
    ctx = stage_context(make_recipe(tmp_path, target_format="none", drafter_format="none"), "q")
    run_quantize_stage(ctx)
    assert not (ctx.out / "target" / "hf_quant_config.json").exists()
    assert (ctx.out / "drafter" / "model.safetensors").exists()
    from dflash_trt.recipe import ModelQuant

    recipe = make_recipe(tmp_path)
    bad = recipe.model_copy(update={"quantize": recipe.quantize.model_copy(
        update={"drafter": ModelQuant(format="fp8", kv_cache="fp8")})})
    with pytest.raises(UsageError, match="quantize.drafter.kv_cache"):
        run_quantize_stage(stage_context(bad, "q2"))
