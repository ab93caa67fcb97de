"""Drafting through the DFlash plugin ops gives what the torch engine's own drafter gives.

`OpsDrafter` is the drafter forward written with the ops: `kv_inject` puts the new context's K/V
into the drafter cache, each layer computes only the block's q/k/v and calls
`block_draft_attention`, and the block's K/V never enter the cache. It wraps a
`dflash_trt.dflash.drafter.DFlashDraftModel` (same weights) and is a drop-in for it in
`dflash_trt.dflash.generate`, so the whole engine loop runs both ways on tiny models.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

if importlib.util.find_spec("dflash_trt.dflash.drafter") is None:
    pytest.skip("dflash_trt.dflash.drafter (DFlashDraftModel) is not in this checkout yet",
                allow_module_level=True)
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # before any `import triton`: see test_plugin_kernels

from dflash_fixtures import random_prompts, tiny_drafter, tiny_target  # noqa: E402

from dflash_trt.dflash.generate import accept_greedy, generate  # noqa: E402
from dflash_trt.dflash.target import HFTarget  # noqa: E402
from dflash_trt.plugins import load_dflash_ops  # noqa: E402

ops = load_dflash_ops()


def _rope(x, cos, sin):  # x [heads, T, D]; cos, sin [T, D]
    return x * cos + ops.reference.rotate_half(x) * sin


class OpsDrafter(torch.nn.Module):
    """DFlashDraftModel's forward with the plugin ops (batch 1), recording every output."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter
        self.mask_token_id = drafter.mask_token_id
        self.outputs: list[torch.Tensor] = []

    def new_cache(self):
        return self.drafter.new_cache()

    def forward(self, noise_embedding, target_hidden, cache):
        d = self.drafter
        past, num_ctx, block = cache.get_seq_length(), target_hidden.shape[1], noise_embedding.shape[1]
        positions = torch.arange(past, past + num_ctx + block)[None]  # (1, C+B) absolute
        cos, sin = d.rotary_emb(noise_embedding, positions)  # (1, C+B, D) each
        attn = [layer.self_attn for layer in d.layers]
        head_dim = attn[0].head_dim
        # 1. KV injection: the new context's K/V for every layer, appended to the drafter cache.
        if num_ctx:
            kv = torch.ops.dflash.kv_inject(
                target_hidden[0], d.fc.weight, d.hidden_norm.weight,
                [a.k_proj.weight for a in attn], [a.v_proj.weight for a in attn],
                [a.k_norm.weight for a in attn], cos[0, :num_ctx], sin[0, :num_ctx],
                d.config.rms_norm_eps)  # [L, 2, Hkv, C, D]
            for i in range(len(attn)):
                cache.update(i, kv[i, 0][None], kv[i, 1][None])  # (1, Hkv, S+C, D)
        # 2. Block drafting: queries and the block's own K/V from the block only.
        cos_b, sin_b = cos[0, num_ctx:], sin[0, num_ctx:]  # [B, D]
        x = noise_embedding  # (1, B, H)
        for i, (layer, a) in enumerate(zip(d.layers, attn, strict=True)):
            h = layer.input_layernorm(x)[0]  # [B, H]
            q = _rope(a.q_norm(a.q_proj(h).view(block, -1, head_dim)).transpose(0, 1), cos_b, sin_b)
            k = _rope(a.k_norm(a.k_proj(h).view(block, -1, head_dim)).transpose(0, 1), cos_b, sin_b)
            v = a.v_proj(h).view(block, -1, head_dim).transpose(0, 1)  # [Hkv, B, D]
            out = torch.ops.dflash.block_draft_attention(
                q, cache.keys[i][0], cache.values[i][0], k, v, 0)  # [Hq, B, D]
            x = x + a.o_proj(out.transpose(0, 1).reshape(1, block, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        hidden = d.norm(x)  # (1, B, H)
        self.outputs.append(hidden)
        return hidden


class RecordingDrafter(torch.nn.Module):
    """The engine's drafter as it is, recording every output."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter, self.mask_token_id = drafter, drafter.mask_token_id
        self.outputs: list[torch.Tensor] = []

    def new_cache(self):
        return self.drafter.new_cache()

    def forward(self, noise_embedding, target_hidden, cache):
        hidden = self.drafter(noise_embedding, target_hidden, cache)
        self.outputs.append(hidden)
        return hidden


@pytest.fixture(scope="module")
def models():
    model = tiny_target("qwen3", layers=4)
    drafter = tiny_drafter(model, block_size=4, num_layers=2, target_layer_ids=[0, 2])
    return HFTarget(model, drafter.target_layer_ids), drafter


def _draft_three_blocks(drafter_like, target, block_size):
    """Three drafter calls as generate makes them: new context, a block, then a crop."""
    g = torch.Generator().manual_seed(3)
    cache = drafter_like.new_cache()
    feature_dim = target.embed_tokens.weight.shape[1] * len(target.layer_ids)
    outputs, start = [], 0
    for num_ctx in (7, 3, 1):
        context = torch.randn(1, num_ctx, feature_dim, generator=g)
        block = torch.randint(0, 100, (1, block_size), generator=g)
        outputs.append(drafter_like(target.embed(block), context, cache))
        start += num_ctx
        cache.crop(start)
    return outputs


@torch.inference_mode()
def test_ops_forward_matches_drafter(models):
    target, drafter = models
    want = _draft_three_blocks(drafter, target, 4)
    got = _draft_three_blocks(OpsDrafter(drafter), target, 4)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton-lang not installed")
def test_ops_forward_matches_drafter_with_triton_kernels(models):
    """The same, through the Triton kernels (the CPU interpreter here, compiled on CUDA)."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
    target, drafter = models
    want = _draft_three_blocks(drafter, target, 4)
    ops.set_backend("triton")
    try:
        got = _draft_three_blocks(OpsDrafter(drafter), target, 4)
    finally:
        ops.set_backend("auto")
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
@pytest.mark.parametrize(("block_size", "num_prompts"), [(2, 1), (4, 2)])
def test_generation_is_identical_with_and_without_ops(models, block_size, num_prompts):
    target, drafter = models
    for prompt in random_prompts(num_prompts, seed=block_size):
        plain, with_ops = RecordingDrafter(drafter), OpsDrafter(drafter)
        tokens, stats = generate(target, plain, prompt, max_new_tokens=10, block_size=block_size)
        tokens_ops, stats_ops = generate(target, with_ops, prompt, max_new_tokens=10,
                                         block_size=block_size)
        greedy, _ = generate(target, None, prompt, max_new_tokens=10, block_size=1)
        assert tokens_ops == tokens == greedy
        assert stats_ops.acceptance_lengths == stats.acceptance_lengths
        assert len(with_ops.outputs) == len(plain.outputs) > 0
        for w, g in zip(plain.outputs, with_ops.outputs, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
            assert torch.equal(target.logits(g).argmax(-1), target.logits(w).argmax(-1))


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
