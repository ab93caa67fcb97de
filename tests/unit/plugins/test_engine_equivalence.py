"""The torch engine's drafter runs the DFlash plugin ops, and gives the same tokens without them.

`DFlashDraftModel` drafts through `kv_inject` and `block_draft_attention` at inference (batch 1
with a DraftCache) and through plain torch otherwise or when `use_ops` is False. These tests run
the real drafter, `generate` and `TorchEngine` both ways on tiny Llama and Qwen3 targets, and the
ops path once more through the Triton kernels (Triton's CPU interpreter without a GPU).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import warnings

import pytest
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # before any `import triton`: see test_plugin_kernels

from dflash_fixtures import random_prompts, tiny_drafter, tiny_target, write_tiny_checkpoint  # noqa: E402

from dflash_trt.dflash import drafter as drafter_module  # noqa: E402
from dflash_trt.dflash.generate import accept_greedy, generate  # noqa: E402
from dflash_trt.dflash.target import HFTarget  # noqa: E402
from dflash_trt.engines.base import SamplingParams  # noqa: E402
from dflash_trt.errors import DflashTrtError  # noqa: E402
from dflash_trt.plugins import DFLASH_MODULE, load_dflash_ops  # noqa: E402

ops = load_dflash_ops()
FAMILIES = ("llama", "qwen3")


@pytest.fixture(scope="module", params=FAMILIES)
def models(request):
    """A tiny target (4 layers, GQA 4/2) and a random 2-layer drafter reading layers 0 and 2."""
    model = tiny_target(request.param, layers=4)
    drafter = tiny_drafter(model, block_size=4, num_layers=2, target_layer_ids=[0, 2], seed=2)
    return HFTarget(model, drafter.target_layer_ids), drafter


@pytest.fixture
def op_calls(monkeypatch):
    """Counts of kv_inject / block_draft_attention calls made through the loaded plugin."""
    calls = {"kv_inject": 0, "block_draft_attention": 0}
    for name in calls:
        op = getattr(ops, name)

        def counted(*args, _op=op, _name=name):
            calls[_name] += 1
            return _op(*args)
        monkeypatch.setattr(ops, name, counted)
    return calls


def _draft_three_blocks(drafter, target, block_size, *, use_ops, device="cpu"):
    """Three drafter calls as generate makes them (new context, a block, crop); outputs and cache."""
    g = torch.Generator().manual_seed(3)
    drafter.use_ops = use_ops
    cache = drafter.new_cache()
    feature_dim = target.embed_tokens.weight.shape[1] * len(target.layer_ids)
    outputs, start = [], 0
    try:
        for num_ctx in (7, 3, 1):
            context = torch.randn(1, num_ctx, feature_dim, generator=g).to(device)
            block = torch.randint(0, 100, (1, block_size), generator=g).to(device)
            outputs.append(drafter(target.embed(block), context, cache))  # (1, B, H)
            assert cache.get_seq_length() == start + num_ctx + block_size
            start += num_ctx
            cache.crop(start)
    finally:
        drafter.use_ops = True
    layers = [cache.get(i) for i in range(len(drafter.layers))]
    return outputs, layers


@torch.inference_mode()
@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_drafter_forward_with_ops_equals_plain_torch(models, op_calls, block_size):
    target, drafter = models
    want, want_cache = _draft_three_blocks(drafter, target, block_size, use_ops=False)
    assert op_calls == {"kv_inject": 0, "block_draft_attention": 0}
    got, got_cache = _draft_three_blocks(drafter, target, block_size, use_ops=True)
    assert op_calls == {"kv_inject": 3, "block_draft_attention": 3 * len(drafter.layers)}
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for (wk, wv), (gk, gv) in zip(want_cache, got_cache, strict=True):  # (1, Hkv, 11, D)
        torch.testing.assert_close(gk, wk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gv, wv, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_generation_is_identical_with_and_without_ops(models, block_size):
    """Temperature 0: same tokens, same acceptance, same drafts (argmax) each step, both ways."""
    target, drafter = models
    drafted: list[torch.Tensor] = []
    hook = drafter.register_forward_hook(lambda _m, _a, out: drafted.append(out))
    try:
        for prompt in random_prompts(3, seed=block_size):
            runs = {}
            for use_ops in (False, True):
                drafter.use_ops = use_ops
                drafted.clear()
                tokens, stats = generate(target, drafter, prompt, max_new_tokens=16,
                                         block_size=block_size)
                runs[use_ops] = tokens, stats.acceptance_lengths, list(drafted)
            greedy, _ = generate(target, None, prompt, max_new_tokens=16, block_size=1)
            (tokens, lengths, plain), (tokens_ops, lengths_ops, with_ops) = runs[False], runs[True]
            assert tokens_ops == tokens == greedy
            assert lengths_ops == lengths
            assert len(with_ops) == len(plain) > 0
            for w, g in zip(plain, with_ops, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
                assert torch.equal(target.logits(g).argmax(-1), target.logits(w).argmax(-1))
    finally:
        hook.remove()
        drafter.use_ops = True


@pytest.mark.parametrize("family", FAMILIES)
def test_torch_engine_outputs_are_identical_with_and_without_ops(tmp_path, family):
    from dflash_trt.dflash.drafter_init import init_drafter_for_target
    from dflash_trt.engines.torch_engine import TorchEngine

    target_dir = write_tiny_checkpoint(tmp_path / "target", family)
    init_drafter_for_target(target_dir, num_layers=2, block_size=4, target_layer_ids=[0, 2],
                            seed=1).save_pretrained(tmp_path / "drafter")
    engine = TorchEngine.load(target_dir, tmp_path / "drafter", max_seq_len=256)
    assert engine.drafter.use_ops
    params = SamplingParams(max_new_tokens=24, temperature=0.0)
    drafted: list[torch.Tensor] = []  # drafter outputs: a random drafter rarely gets accepted
    engine.drafter.register_forward_hook(lambda _m, _a, out: drafted.append(out))
    for prompt in ["hello", "The quick brown fox", "def f(x):"]:
        ids = engine.tokenize(prompt)
        results, hidden = {}, {}
        for use_ops in (False, True):
            engine.drafter.use_ops = use_ops
            drafted.clear()
            steps = list(engine.stream(ids, params))
            results[use_ops] = ([s.token_ids for s in steps], [s.text for s in steps],
                                [s.num_accepted_draft_tokens for s in steps])
            hidden[use_ops] = list(drafted)
        assert len(results[True][0]) > 1  # prefill step plus speculative steps
        assert results[True] == results[False]
        assert len(hidden[True]) == len(hidden[False]) > 0
        for w, g in zip(hidden[False], hidden[True], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def _bias_drafter(model):
    config = tiny_drafter(model).config
    config.attention_bias = True
    from dflash_trt.dflash.drafter_init import init_drafter

    return init_drafter(config, seed=1)


@torch.inference_mode()
def test_plain_torch_when_ops_do_not_apply(models, op_calls):
    """No cache (training), batch 2, attention bias, or use_ops False: plain torch, no op call."""
    target, drafter = models
    g = torch.Generator().manual_seed(0)
    feature_dim = target.embed_tokens.weight.shape[1] * 2
    noise, context = torch.randn(2, 4, 64, generator=g), torch.randn(2, 5, feature_dim, generator=g)
    drafter(noise[:1], context[:1])
    batched = drafter(noise, context, drafter.new_cache())
    single = drafter(noise[1:], context[1:], drafter.new_cache())
    biased = _bias_drafter(target.model)
    biased(noise[:1], context[:1, :, :biased.fc.in_features], biased.new_cache())
    drafter.use_ops = False
    try:
        drafter(noise[:1], context[:1], drafter.new_cache())
    finally:
        drafter.use_ops = True
    assert op_calls == {"kv_inject": 1, "block_draft_attention": 2}  # only `single` used them
    torch.testing.assert_close(batched[1:], single, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_falls_back_to_plain_torch_when_the_ops_cannot_load(models, monkeypatch):
    target, drafter = models
    want, _ = _draft_three_blocks(drafter, target, 4, use_ops=False)

    def broken():
        raise DflashTrtError("the DFlash plugin (plugins/dflash) is missing")
    monkeypatch.setattr("dflash_trt.plugins.load_dflash_ops", broken)
    drafter_module._load_ops.cache_clear()
    try:
        with pytest.warns(UserWarning, match="plugin ops unavailable"):
            got, _ = _draft_three_blocks(drafter, target, 4, use_ops=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once, not on every call
            _draft_three_blocks(drafter, target, 4, use_ops=True)
    finally:
        drafter_module._load_ops.cache_clear()
    for w, g in zip(want, got, strict=True):
        assert torch.equal(g, w)  # the very same computation


def test_importing_the_drafter_does_not_load_the_plugin():
    code = (f"import sys, dflash_trt.dflash.drafter, dflash_trt.engines.torch_engine; "
            f"sys.exit({DFLASH_MODULE!r} in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


@torch.inference_mode()
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton-lang not installed")
def test_drafting_through_triton_kernels_matches_plain_torch():
    """The ops path through the Triton kernels (the CPU interpreter here, compiled on CUDA)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    model = tiny_target("qwen3", layers=4).to(device)
    drafter = tiny_drafter(model, block_size=4, num_layers=2, target_layer_ids=[0, 2]).to(device)
    target = HFTarget(model, drafter.target_layer_ids)
    want, _ = _draft_three_blocks(drafter, target, 4, use_ops=False, device=device)
    ops.set_backend("triton")
    try:
        got, _ = _draft_three_blocks(drafter, target, 4, use_ops=True, device=device)
        prompt = random_prompts(1, seed=7)[0]
        tokens, stats = generate(target, drafter, prompt, max_new_tokens=8, block_size=4)
    finally:
        ops.set_backend("auto")
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    drafter.use_ops = False
    try:
        plain_tokens, plain_stats = generate(target, drafter, prompt, max_new_tokens=8, block_size=4)
    finally:
        drafter.use_ops = True
    assert tokens == plain_tokens
    assert stats.acceptance_lengths == plain_stats.acceptance_lengths


def test_accept_op_matches_engine_greedy_acceptance():
    g = torch.Generator().manual_seed(0)
    for keep in range(4):
        logits = torch.randn(4, 50, generator=g)  # (g+1, V)
        best = logits.argmax(-1).tolist()
        drafts = best[:3]
        if keep < 3:
            drafts[keep] = (drafts[keep] + 1) % 50
        want = accept_greedy(logits, drafts)
        n, nxt = ops.accept(torch.tensor([drafts]), logits[None])
        assert (int(n[0]), int(nxt[0])) == want
        assert want[0] == keep
