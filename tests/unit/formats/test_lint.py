"""The checkpoint linter on synthetic NVFP4/FP8 checkpoints with one defect each, and its CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from dflash_trt.commands.quantize import lint_checkpoint as lint_command
from dflash_trt.formats import qformats as qf
from dflash_trt.formats.lint import lint_checkpoint, lint_drafter_compat, lint_pair

LAYERS = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj")
HIDDEN, VOCAB, NUM_LAYERS = 64, 128, 4


def nvfp4_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g),
             "model.norm.weight": torch.ones(HIDDEN)}
    for name in LAYERS:
        q = qf.nvfp4_quantize(torch.randn(HIDDEN, HIDDEN, generator=g) * 0.02)
        state |= {f"{name}.weight": q.packed, f"{name}.weight_scale": q.weight_scale,
                  f"{name}.weight_scale_2": q.weight_scale_2,
                  f"{name}.input_scale": torch.tensor(0.01)}
    return state


def write_ckpt(path: Path, state: dict, algo: str = "NVFP4", exclude=("model.embed_tokens", "lm_head"),
               rope_theta: float = 10000.0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    quant = {"quant_algo": algo, "kv_cache_quant_algo": None, "group_size": 16,
             "exclude_modules": list(exclude)}
    (path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "test"},
                                                           "quantization": quant}))
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN, "vocab_size": VOCAB,
              "num_hidden_layers": NUM_LAYERS, "rope_theta": rope_theta,
              "quantization_config": {"quant_method": "modelopt", "quant_algo": algo}}
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_drafter(path: Path, target_layer_ids=(1, 2), mask_token_id=VOCAB - 1,
                  rope_theta: float = 10000.0, hidden: int = HIDDEN) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["DFlashDraftModel"], "hidden_size": hidden, "vocab_size": VOCAB,
              "num_hidden_layers": 1, "num_target_layers": NUM_LAYERS, "block_size": 4,
              "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
              "dflash_config": {"mask_token_id": mask_token_id,
                                "target_layer_ids": list(target_layer_ids)}}
    (path / "config.json").write_text(json.dumps(config))
    fc = torch.zeros(hidden, len(target_layer_ids) * hidden)
    save_file({"fc.weight": fc, "norm.weight": torch.ones(hidden)}, str(path / "model.safetensors"))
    return path


def messages(findings) -> str:
    return "\n".join(str(f) for f in findings)


def test_clean_nvfp4_checkpoint_has_no_findings(tmp_path):
    assert lint_checkpoint(write_ckpt(tmp_path / "t", nvfp4_tensors())) == []


def test_clean_fp8_checkpoint_has_no_findings(tmp_path):
    state = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN)}
    for name in LAYERS:
        w, s = qf.fp8_quantize(torch.randn(HIDDEN, HIDDEN))
        state |= {f"{name}.weight": w, f"{name}.weight_scale": s, f"{name}.input_scale": s.clone()}
    assert lint_checkpoint(write_ckpt(tmp_path / "t", state, algo="FP8")) == []


def test_flags_wrong_scale_dtype(tmp_path):
    state = nvfp4_tensors()
    state[f"{LAYERS[0]}.weight_scale"] = state[f"{LAYERS[0]}.weight_scale"].float()
    out = messages(lint_checkpoint(write_ckpt(tmp_path / "t", state)))
    assert f"{LAYERS[0]}.weight_scale: dtype F32, NVFP4 needs F8_E4M3" in out


def test_flags_missing_scale(tmp_path):
    state = nvfp4_tensors()
    del state[f"{LAYERS[1]}.weight_scale_2"]
    out = messages(lint_checkpoint(write_ckpt(tmp_path / "t", state)))
    assert f"{LAYERS[1]}.weight_scale_2: missing" in out


def test_flags_bf16_sized_nvfp4_file(tmp_path):
    state = nvfp4_tensors()
    for name in LAYERS:  # the classic: scales present, but the weights were never packed to FP4
        state[f"{name}.weight"] = torch.randn(HIDDEN, HIDDEN).to(torch.bfloat16)
    findings = lint_checkpoint(write_ckpt(tmp_path / "t", state))
    out = messages(findings)
    for name in LAYERS:
        assert f"{name}.weight: dtype BF16, NVFP4 needs U8" in out
        assert f"{name}.weight: {HIDDEN * HIDDEN * 2} bytes on disk; NVFP4 [{HIDDEN}, {HIDDEN}] packs into {HIDDEN * HIDDEN // 2}" in out


def test_flags_exclude_list_that_disagrees(tmp_path):
    # A quantized layer listed as excluded, and an unquantized matrix not listed.
    state = nvfp4_tensors()
    state["lm_head.weight"] = torch.randn(VOCAB, HIDDEN)
    ckpt = write_ckpt(tmp_path / "t", state, exclude=("model.embed_tokens", "model.layers.*.mlp.*"))
    out = messages(lint_checkpoint(ckpt))
    assert f"{LAYERS[1]}: listed in exclude_modules but stores quantized tensors" in out
    assert "lm_head: stored unquantized (F32) but not in exclude_modules" in out


def test_flags_truncated_file(tmp_path):
    ckpt = write_ckpt(tmp_path / "t", nvfp4_tensors())
    data = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(data[:-10])
    assert "truncated or padded file" in messages(lint_checkpoint(ckpt))


def test_flags_drafter_layer_beyond_target(tmp_path):
    target = write_ckpt(tmp_path / "t", nvfp4_tensors())
    good = write_drafter(tmp_path / "good")
    assert lint_pair(target, good) == []
    bad = write_drafter(tmp_path / "bad", target_layer_ids=(1, NUM_LAYERS))
    out = messages(lint_drafter_compat(bad, target))
    assert f"target_layer_ids [{NUM_LAYERS}] out of range: the target has {NUM_LAYERS} layers" in out


@pytest.mark.parametrize("kwargs, expect", [
    ({"mask_token_id": VOCAB}, "mask_token_id 128 is outside the target vocabulary"),
    ({"rope_theta": 5e5}, "RoPE"),
    ({"hidden": 32}, "hidden_size 32 != target hidden_size 64"),
])
def test_flags_drafter_target_mismatch(tmp_path, kwargs, expect):
    target = write_ckpt(tmp_path / "t", nvfp4_tensors())
    assert expect in messages(lint_drafter_compat(write_drafter(tmp_path / "d", **kwargs), target))


@pytest.mark.parametrize("content, expect", [
    ('{"token_ids": [1, 2, 127]}', None),
    ('{"token_ids": [1, 2, 128]}', "token id 128 is outside the target vocabulary (128)"),
    ('{"token_ids": [3, 2]}', "strictly increasing"),
    ('{"ids": [1]}', "strictly increasing"),
    ("[1, 2]", "expected a JSON object"),
])
def test_flags_a_draft_vocabulary_that_does_not_fit(tmp_path, content, expect):
    target = write_ckpt(tmp_path / "t", nvfp4_tensors())
    drafter = write_drafter(tmp_path / "d")
    (drafter / "draft_vocab.json").write_text(content)
    out = messages(lint_drafter_compat(drafter, target))
    assert (expect in out) if expect else "draft_vocab" not in out


def test_cli_exit_codes_and_one_line_per_finding(tmp_path):
    runner = CliRunner()
    target = write_ckpt(tmp_path / "t", nvfp4_tensors())
    ok = runner.invoke(lint_command, [str(target), "--drafter", str(write_drafter(tmp_path / "d"))])
    assert ok.exit_code == 0 and "clean" in ok.output
    state = nvfp4_tensors()
    del state[f"{LAYERS[0]}.weight_scale_2"], state[f"{LAYERS[1]}.input_scale"]
    bad = runner.invoke(lint_command, [str(write_ckpt(tmp_path / "b", state))])
    assert bad.exit_code == 1
    assert sorted(bad.output.strip().splitlines()) == sorted([
        f"{LAYERS[1]}.input_scale: missing; NVFP4 layers store it",
        f"{LAYERS[0]}.weight_scale_2: missing; NVFP4 layers store it"])
    missing = runner.invoke(lint_command, [str(tmp_path / "nope")])
    assert missing.exit_code == 2
