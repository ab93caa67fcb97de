"""dflash.slots: a slot-cache forward equals a DynamicCache forward, with and without a mask."""

from __future__ import annotations

import pytest
import torch
from dflash_fixtures import random_prompts, tiny_target

from dflash_trt.dflash.target import HFTarget


@pytest.fixture(scope="module")
def target():
    return HFTarget(tiny_target("llama").double())


def reference(target, prompt, new):
    """Hidden states of `new` after `prompt`, through the model's own DynamicCache."""
    cache = target.new_cache()
    target.forward(torch.tensor([prompt]), cache, False)
    return target.forward(torch.tensor([new]), cache, False)[0][0]


@pytest.mark.parametrize("width", [1, 3])
def test_rows_at_one_start_need_no_mask_and_match_the_dynamic_cache(target, width):
    prompts = [p[:12] for p in random_prompts(2, seed=1, low=12, high=20)]
    new = [[5, 6, 7][:width], [9, 10, 11][:width]]
    slots = target.new_slot_cache(2, 64)
    target.forward(torch.tensor(prompts), slots.view(0, 2, 12), False)
    slots.lengths[:2] = [12, 12]
    view = slots.view(0, 2, width)
    assert view.causal_mask(torch.device("cpu")) is None
    hidden = target.forward(torch.tensor(new), view, False)[0]
    for r in range(2):
        torch.testing.assert_close(hidden[r], reference(target, prompts[r], new[r]),
                                   rtol=0, atol=1e-12)


def test_rows_at_different_starts_are_masked_each_to_its_own_length(target):
    prompts = random_prompts(3, seed=2, low=3, high=20)
    slots = target.new_slot_cache(3, 64)
    for r, p in enumerate(prompts):  # one row at a time: each its own length
        target.forward(torch.tensor([p]), slots.view(r, r + 1, len(p)), False)
        slots.lengths[r] = len(p)
    new = [[4, 8], [15, 16], [23, 42]]
    view = slots.view(0, 3, 2)
    assert view.causal_mask(torch.device("cpu")) is not None
    hidden = target.forward(torch.tensor(new), view, False)[0]
    for r, p in enumerate(prompts):
        torch.testing.assert_close(hidden[r], reference(target, p, new[r]), rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gqa_sdpa_computes_what_sdpa_computes(family):
    """The engine's float32/float64 attention keeps grouped KV heads under a mask; float64 agrees
    with transformers' sdpa (which copies the heads out) on a prompt, on rows at one start and on
    rows at different starts."""
    models = [HFTarget(tiny_target(family, attention=a).double()) for a in ("sdpa", None)]
    assert models[1].model.config._attn_implementation == "gqa_sdpa"
    prompts = random_prompts(3, seed=5, low=3, high=20)
    outs = []
    for target in models:
        slots = target.new_slot_cache(3, 64)
        hidden = []
        for r, p in enumerate(prompts):
            hidden.append(target.forward(torch.tensor([p]), slots.view(r, r + 1, len(p)),
                                         False)[0][0])
            slots.lengths[r] = len(p)
        hidden.append(target.forward(torch.tensor([[1, 2], [3, 4], [5, 6]]),
                                     slots.view(0, 3, 2), False)[0])  # masked
        slots.lengths[:3] = [30, 30, 30]  # past the prompts: rows at one start, no mask
        hidden.append(target.forward(torch.tensor([[7], [8], [9]]), slots.view(0, 3, 1),
                                     False)[0])
        outs.append(hidden)
    for got, want in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
