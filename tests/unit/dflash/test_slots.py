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


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_packed_forward_computes_each_rows_tokens_as_their_own_forward(family):
    """Rows of different lengths bring 3, 0, 1 and 2 new tokens, a prompt chunk of 20 after
    their prompt and a whole prompt of 18 (wide rows attend on their own), side by side in one
    sequence: each row's hidden states and features equal those of its own tokens after its own
    prompt, each row's cache takes exactly its tokens, and the next forward continues them."""
    target = HFTarget(tiny_target(family).double(), [0, 1])
    assert target.packs
    prompts = [*random_prompts(5, seed=6, low=3, high=20), []]
    new = [[4, 8, 15], [], [16], [23, 42], list(range(30, 50)), list(range(50, 68))]
    slots = target.new_slot_cache(6, 64)
    for r, p in enumerate(prompts[:5]):
        target.forward(torch.tensor([p]), slots.view(r, r + 1, len(p)), False)
        slots.lengths[r] = len(p)
    view = slots.packed(0, 6, [len(n) for n in new])
    assert view.wide == [4, 5] and view.width == 3
    hidden, features = target.forward(torch.tensor([[t for n in new for t in n]]), view, True)
    assert hidden.shape[:2] == features.shape[:2] == (1, sum(map(len, new)))
    for r, (p, n) in enumerate(zip(prompts, new, strict=True)):
        if not n:
            continue
        cache = target.new_cache()
        if p:
            target.forward(torch.tensor([p]), cache, False)
        want_hidden, want_features = target.forward(torch.tensor([n]), cache, True)
        mine = slice(view.offsets[r], view.offsets[r] + len(n))
        torch.testing.assert_close(hidden[:, mine], want_hidden, rtol=0, atol=1e-12)
        torch.testing.assert_close(features[:, mine], want_features, rtol=0, atol=1e-12)
    for r, n in enumerate(new):
        slots.lengths[r] += len(n)
    after = target.forward(torch.tensor([[7 + r] for r in range(6)]), slots.view(0, 6, 1),
                           False)[0]
    for r, (p, n) in enumerate(zip(prompts, new, strict=True)):
        torch.testing.assert_close(after[r], reference(target, p + n, [7 + r]), rtol=0,
                                   atol=1e-12)


def test_a_packed_forward_needs_the_attention_that_unpacks_it():
    target = HFTarget(tiny_target("llama", attention="sdpa").double())
    slots = target.new_slot_cache(2, 16)
    with pytest.raises(ValueError, match="gqa_sdpa"):
        target.forward(torch.tensor([[1, 2, 3]]), slots.packed(0, 2, [2, 1]), False)


def test_a_short_prompt_chunk_beside_a_row_at_its_end_fits_the_cache():
    """The padded pass is as wide as a 10-token prompt chunk, but only real tokens need room: a
    row 1 slot from the end of its cache verifies its token beside it (the padded view of that
    width would not fit), and both rows compute what their own forwards do."""
    target = HFTarget(tiny_target("llama").double())
    slots = target.new_slot_cache(2, 12)
    prompt = random_prompts(1, seed=7, low=11, high=12)[0][:11]
    target.forward(torch.tensor([prompt]), slots.view(0, 1, 11), False)
    slots.lengths[0] = 11
    with pytest.raises(ValueError, match="slot cache full"):
        slots.view(0, 2, 10)
    chunk = list(range(20, 30))
    view = slots.packed(0, 2, [1, 10])
    assert view.width == 10 and view.top == 12
    hidden = target.forward(torch.tensor([[5, *chunk]]), view, False)[0]
    torch.testing.assert_close(hidden[:, :1], reference(target, prompt, [5])[None], rtol=0,
                               atol=1e-12)
    cache = target.new_cache()
    want = target.forward(torch.tensor([chunk]), cache, False)[0]
    torch.testing.assert_close(hidden[:, 1:], want, rtol=0, atol=1e-12)
