"""The verify stage: gates, reports, and real runs with the torch engine on tiny models."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from dflash_trt.engines.base import first_mismatch
from dflash_trt.errors import DflashTrtError
from dflash_trt.stages.verify import (
    PromptResult,
    VerifyReport,
    gate_failures,
    write_reports,
)


def report(acc, base, lossless=True):
    r = VerifyReport("builtin:chat", 1, 8, "nvfp4", "nvfp4", 4)
    r.results.append(PromptResult(5, lossless, None if lossless else 3, acc, base))
    return r


def test_first_mismatch():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2], [1, 2, 3]) == 2


def test_gates():
    assert gate_failures(report([1, 3, 3], [1, 3, 3]), 1.5, 0.5) == []
    assert "differs from plain greedy" in gate_failures(report([1, 3], [1, 3], lossless=False), 1, 1)[0]
    assert "min_acceptance_length" in gate_failures(report([1, 1, 1], [1, 1, 1]), 1.5, 0.5)[0]
    assert "max_acceptance_drop" in gate_failures(report([1, 2, 2], [1, 4, 4]), 1.0, 0.5)[0]


def test_tensorrt_llm_builds_gate_on_the_full_vocabulary_figure():
    r = report([3, 3], [3, 3])
    r.full_vocab_acceptance_lengths = [1, 1]  # drafting the whole vocabulary: nothing passes
    assert gate_failures(r, 1.5, 0.5) == []  # the torch engine drafts the draft vocabulary
    r.gate_on_full_vocab = True
    (failure,) = gate_failures(r, 1.5, 0.5)
    assert "over the full vocabulary" in failure and "1.00 < verify.min_acceptance_length" in failure
    assert r.to_dict()["full_vocab_acceptance_length"] == 1.0


def test_reports_are_written(tmp_path):
    write_reports(report([1, 2, 4], [1, 4, 4]), tmp_path)
    data = json.loads((tmp_path / "verify.json").read_text())
    assert data["acceptance_length"] == pytest.approx(7 / 3) and data["acceptance_drop"] == pytest.approx(2 / 3)
    assert "| mean acceptance length, quantized pair | 2.333 |" in (tmp_path / "verify.md").read_text()
    assert (tmp_path / "acceptance.png").read_bytes()[:4] == b"\x89PNG"


# --- with the torch engine ------------------------------------------------------------------


def constant_pair():
    """A target whose greedy output is one constant token, and a drafter that predicts it only
    through its context features (fc): with fc zeroed every draft is wrong.

    All embedding rows are the same vector u, so every target position computes the same hidden
    state and the same argmax c. The drafter attends uniformly (q = 0); its value path reads the
    component along u-hat of the injected context (fc maps the target features to -u-hat) and of
    the block (+u-hat), and writes -gamma times that along z-hat, the direction of the target's
    normed final hidden state. With real context the drafts point along +z-hat (token c); without
    it (fc = 0) they point along -z-hat (never c).
    """
    from dflash_fixtures import tiny_drafter, tiny_target

    target = tiny_target("llama", seed=0, layers=4)
    hidden = target.config.hidden_size
    g = torch.Generator().manual_seed(1)
    u_hat = torch.nn.functional.normalize(torch.randn(hidden, generator=g), dim=0)
    with torch.no_grad():
        target.model.embed_tokens.weight.copy_(0.01 * u_hat.expand_as(target.model.embed_tokens.weight))
        out = target(torch.zeros(1, 1, dtype=torch.long), output_hidden_states=True)
        feats = torch.cat([out.hidden_states[2][0, 0], out.hidden_states[3][0, 0]])  # layers [1, 2]
        z_hat = torch.nn.functional.normalize(target.model.norm(out.hidden_states[-1][0, 0]), dim=0)
    drafter = tiny_drafter(target, block_size=4, num_layers=1, target_layer_ids=[1, 2])
    gamma = 8.0
    with torch.no_grad():
        drafter.fc.weight.copy_(-torch.outer(u_hat, feats) / feats.dot(feats))  # fc(feats) = -u_hat
        attn = drafter.layers[0].self_attn
        attn.q_proj.weight.zero_()
        attn.v_proj.weight.zero_()
        attn.v_proj.weight[0] = u_hat  # kv head 0, dim 0 reads the u-hat component
        attn.o_proj.weight.zero_()
        attn.o_proj.weight[:, 0] = -gamma * z_hat  # head 0, dim 0 writes along -z-hat
        drafter.layers[0].mlp.down_proj.weight.zero_()
    return target, drafter


def short_prompts(tmp_path) -> str:
    path = tmp_path / "prompts.txt"
    path.write_text("def add(a, b):\nHello there, robot\n")
    return str(path)


@pytest.fixture
def engine_available():
    pytest.importorskip("dflash_trt.engines.torch_engine")


def test_verify_passes_a_working_drafter_and_fails_a_zeroed_fc(tmp_path, engine_available):
    from quant_fixtures import make_recipe, stage_context, write_resolved

    from dflash_trt.stages.verify import run_verify_stage

    verify = {"prompts": short_prompts(tmp_path), "num_prompts": 2, "max_new_tokens": 12,
              "min_acceptance_length": 2.0, "max_acceptance_drop": 0.5}
    target, drafter = constant_pair()
    for name, fc_zero in (("good", False), ("broken", True)):
        root = tmp_path / name
        if fc_zero:
            with torch.no_grad():
                drafter.fc.weight.zero_()
        write_resolved(root / "tiny" / "resolved", target=target, drafter=drafter)
        shutil.copytree(root / "tiny" / "resolved", root / "tiny" / "quantized")
        recipe = make_recipe(root, target_format="none", drafter_format="none", verify=verify)
        ctx = stage_context(recipe, "reports")
        if not fc_zero:
            info = run_verify_stage(ctx)
            assert info["lossless"] and info["acceptance_length"] >= 2.5
        else:
            with pytest.raises(DflashTrtError, match="min_acceptance_length"):
                run_verify_stage(ctx)
            data = json.loads((ctx.out / "verify.json").read_text())
            assert data["acceptance_length"] == 1.0 and not data["passed"]


def test_verify_on_nvfp4_build_is_lossless_and_reports_quant_error(tmp_path, engine_available):
    pytest.importorskip("modelopt.torch.quantization")
    from quant_fixtures import make_recipe, stage_context, write_resolved

    from dflash_trt.stages.quantize import run_quantize_stage
    from dflash_trt.stages.verify import run_verify_stage

    write_resolved(tmp_path / "tiny" / "resolved")  # random tiny target: outputs are not trivial
    verify = {"prompts": short_prompts(tmp_path), "num_prompts": 2, "max_new_tokens": 10,
              "min_acceptance_length": 1.0, "max_acceptance_drop": 3.0}
    recipe = make_recipe(tmp_path, verify=verify)
    qctx = stage_context(recipe, "quantized")
    run_quantize_stage(qctx)
    qctx.out.rename(qctx.stage_dir("quantize"))
    ctx = stage_context(recipe, "reports")
    info = run_verify_stage(ctx)
    assert info["lossless"]
    q = info["quant_error"]
    assert q["positions"] > 0 and 0.0 <= q["top1_agreement"] <= 1.0 and q["mean_kl"] > 0.0
    md = (ctx.out / "verify.md").read_text()
    assert "**PASSED**" in md and "top-1 agreement" in md
