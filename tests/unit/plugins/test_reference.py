"""The DFlash ops' torch reference against independent formulations (transformers' Qwen3 modules,
torch's SDPA, hand-made acceptance cases, and a chi-square test of rejection sampling)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from dflash_trt.plugins import load_dflash_ops

ops = load_dflash_ops()
ref = ops.reference
cases = importlib.import_module(f"{ops.__name__}.cases")


def test_kv_inject_matches_qwen3_modules():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    dims = cases.DrafterShape(hidden=32, num_q_heads=4, num_kv_heads=2, head_dim=16,
                              num_layers=2, num_target_layers=3, block_size=4, vocab=64)
    features, fc, hn, wks, wvs, kns, cos, sin, eps = cases.kv_inject_inputs(
        dims, 6, 20, torch.float32)
    hidden_norm = Qwen3RMSNorm(32, eps=eps)
    hidden_norm.weight.data = hn
    hidden = hidden_norm(F.linear(features, fc))  # [T, H]
    kv = ref.kv_inject(features, fc, hn, wks, wvs, kns, cos, sin, eps)
    for layer in range(2):
        k_norm = Qwen3RMSNorm(16, eps=eps)
        k_norm.weight.data = kns[layer]
        k = k_norm(F.linear(hidden, wks[layer]).view(6, 2, 16)).transpose(0, 1)[None]  # [1, Hkv, T, D]
        _, k = apply_rotary_pos_emb(k, k, cos[None], sin[None])
        v = F.linear(hidden, wvs[layer]).view(6, 2, 16).transpose(0, 1)
        torch.testing.assert_close(kv[layer, 0], k[0])
        torch.testing.assert_close(kv[layer, 1], v)


@pytest.mark.parametrize("window", [0, 5, 100])
def test_block_draft_attention_matches_sdpa(window):
    dims = cases.DrafterShape(hidden=0, num_q_heads=6, num_kv_heads=2, head_dim=8, num_layers=1,
                              num_target_layers=1, block_size=3, vocab=0)
    q, k_ctx, v_ctx, k_blk, v_blk = cases.attention_inputs(dims, 11, torch.float32)
    k = torch.cat((k_ctx, k_blk), dim=1)  # [Hkv, 14, D]
    v = torch.cat((v_ctx, v_blk), dim=1)
    visible = torch.ones(3, 14, dtype=torch.bool)
    if window:
        visible[:, : max(0, 11 - window)] = False  # only the last `window` context positions
    want = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=visible,
                                          enable_gqa=True)[0]
    got = ref.block_draft_attention(q, k_ctx, v_ctx, k_blk, v_blk, window)
    torch.testing.assert_close(got, want)


def test_greedy_accept_lengths_and_bonus():
    logits = torch.zeros(3, 4, 10)
    targets = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]])
    logits.scatter_(2, targets[..., None], 1.0)
    drafts = torch.tensor([[1, 2, 3], [1, 9, 3], [0, 6, 7]])
    num_accepted, next_token = ref.accept(drafts, logits)
    assert num_accepted.tolist() == [3, 1, 0]
    assert next_token.tolist() == [4, 2, 5]  # bonus after a full block; the correction otherwise


def test_inverse_cdf_never_draws_zero_mass():
    dist = torch.tensor([[0.0, 0.0, 2.0, 0.0, 1.0, 0.0]] * 3)
    u = torch.tensor([0.0, 0.5, 0.9999999])
    assert ref.inverse_cdf(dist, u).tolist() == [2, 2, 4]
    assert ref.inverse_cdf(dist, torch.tensor([0.7, 0.7, 0.7])).tolist() == [4, 4, 4]


def test_rejection_sampling_reproduces_the_target_distribution():
    """Chi-square: the first emitted token of each block is distributed as p_target[0]."""
    vocab, num_blocks = 6, 60000
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])
    q = torch.tensor([0.05, 0.10, 0.40, 0.05, 0.30, 0.10])  # a poor drafter
    target = p.expand(num_blocks, 2, vocab)
    draft = q.expand(num_blocks, 1, vocab)
    tokens = torch.multinomial(q, num_blocks, replacement=True, generator=g)[:, None]
    u = torch.rand(num_blocks, 2, generator=g)
    num_accepted, next_token = ref.accept(tokens, target, draft, u)
    first = torch.where(num_accepted == 1, tokens[:, 0], next_token)
    counts = torch.bincount(first, minlength=vocab).double()
    expected = p.double() * num_blocks
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 20.5  # 5 degrees of freedom: p = 0.001
    # A broken sampler that always emits the draft token is far outside that bound.
    broken = torch.bincount(tokens[:, 0], minlength=vocab).double()
    assert ((broken - expected) ** 2 / expected).sum().item() > 1000


def test_accept_sampling_needs_uniforms():
    tokens, p, q, _ = cases.accept_inputs(2, 3, 20, torch.float32)
    with pytest.raises(ValueError, match="uniforms"):
        ref.accept(tokens, p, q)
