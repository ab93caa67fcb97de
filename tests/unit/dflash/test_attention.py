"""Row-wise attention: a verify block computes, row for row, what decoding steps compute."""

from __future__ import annotations

import pytest
import torch
from dflash_fixtures import random_prompts, tiny_target
from transformers import DynamicCache

from dflash_trt.dflash import attention


def _rowwise_linear(linear):
    """One matmul per row: row-invariant by construction. Whether a CPU's bf16 matmul is
    row-invariant depends on its kernels (on one machine k_proj, 64 -> 32, was not for some row
    counts), which is not what these tests are about: the attention's schedule is."""
    def forward(x):
        rows = [torch.nn.functional.linear(x[..., i:i + 1, :], linear.weight, linear.bias)
                for i in range(x.shape[-2])]
        return torch.cat(rows, dim=-2)
    linear.forward = forward


def _half_target(dtype=torch.bfloat16, impl=None):
    model = tiny_target(layers=3).to(dtype)
    model.config._attn_implementation = impl or attention.implementation_for(dtype)
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            _rowwise_linear(module)
    return model


def _hidden(model, prompt, tokens, chunks):
    """Final hidden states of `tokens` after `prompt`, fed in pieces of the given sizes."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model.model(input_ids=prompt, past_key_values=cache, use_cache=True)
        out, start = [], 0
        for size in chunks:
            piece = tokens[:, start:start + size]
            out.append(model.model(input_ids=piece, past_key_values=cache,
                                   use_cache=True).last_hidden_state)
            start += size
    return torch.cat(out, dim=1)


def _chunks(total, seed):
    g, sizes = torch.Generator().manual_seed(seed), []
    while sum(sizes) < total:
        sizes.append(min(int(torch.randint(1, 9, (1,), generator=g)), total - sum(sizes)))
    return sizes


def test_half_precision_runs_the_rowwise_implementation():
    assert attention.implementation_for(torch.bfloat16) == attention.NAME
    assert attention.implementation_for(torch.float16) == attention.NAME
    assert attention.implementation_for(torch.float32) == attention.GQA_NAME
    assert attention.implementation_for(torch.float32, device="cuda:0") == "sdpa"


@pytest.mark.parametrize("prompt_len", [3, 37, 130])
def test_bf16_verify_blocks_equal_decoding_steps_bit_for_bit(prompt_len):
    model = _half_target()
    g = torch.Generator().manual_seed(prompt_len)
    prompt = torch.randint(0, 127, (1, prompt_len), generator=g)
    tokens = torch.randint(0, 127, (1, 60), generator=g)
    steps = _hidden(model, prompt, tokens, [1] * 60)
    blocks = _hidden(model, prompt, tokens, _chunks(60, prompt_len))
    assert torch.equal(steps, blocks)


@pytest.mark.parametrize("chunks", [[5, 3, 8], [attention.MAX_ROWS + 6]])
def test_rowwise_computes_what_sdpa_computes(chunks):
    """Same attention, different schedule: float64 agrees with sdpa to rounding (including the
    masked path for a cached chunk longer than MAX_ROWS)."""
    rowwise = _half_target(torch.float64, attention.register())
    sdpa = _half_target(torch.float64, "sdpa")
    prompt = torch.tensor(random_prompts(1, seed=3, low=10, high=11))
    tokens = torch.randint(0, 127, (1, sum(chunks)), generator=torch.Generator().manual_seed(1))
    got = _hidden(rowwise, prompt, tokens, chunks)
    want = _hidden(sdpa, prompt, tokens, [1] * sum(chunks))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_rowwise_refuses_a_batch_it_cannot_mask():
    model = _half_target()
    cache = DynamicCache(config=model.config)
    ids = torch.randint(0, 127, (2, 4))
    with torch.no_grad(), pytest.raises(ValueError, match="batch 1"):  # no mask would pad it
        model.model(input_ids=ids, past_key_values=cache, use_cache=True)


def test_sliding_window_models_keep_sdpa():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    assert attention.implementation_for(torch.bfloat16, LlamaConfig()) == attention.NAME
    assert attention.implementation_for(torch.bfloat16, MistralConfig()) == "sdpa"  # window 4096
    assert attention.implementation_for(torch.bfloat16, Qwen2Config()) == attention.NAME
    windowed = Qwen2Config(use_sliding_window=True, sliding_window=64, max_window_layers=0)
    assert attention.implementation_for(torch.bfloat16, windowed) == "sdpa"
