"""dflash.draft_length: the chooser, and generation with it (lossless greedy, exact sampling)."""

from __future__ import annotations

import random

import pytest

from dflash_trt.dflash.draft_length import StepCosts, choose_draft_length

# A CPU-like cost shape: a verify over n tokens costs more with n, drafting costs a fifth of it.
COSTS = StepCosts(verify_s=tuple(0.060 + 0.006 * n for n in range(8)), draft_s=0.014)


def test_drafts_that_never_pass_are_not_verified():
    assert choose_draft_length([0.0] * 7, COSTS) == 0
    assert choose_draft_length([0.01] * 7, COSTS) == 0


def test_drafts_that_always_pass_are_all_verified():
    assert choose_draft_length([1.0] * 7, COSTS) == 7
    assert choose_draft_length([0.999] * 7, COSTS) == 7


def test_the_chooser_stops_where_the_confidence_falls():
    assert choose_draft_length([0.95, 0.9, 0.05, 0.9, 0.9, 0.9, 0.9], COSTS) == 2


def test_expensive_verifies_shorten_the_draft():
    steep = StepCosts(verify_s=tuple(0.060 * (1 + n) for n in range(8)), draft_s=0.014)
    assert choose_draft_length([0.6] * 7, COSTS) > choose_draft_length([0.6] * 7, steep)


def test_it_never_verifies_more_than_it_drafted_or_the_costs_cover():
    assert choose_draft_length([1.0] * 3, COSTS) == 3
    short = StepCosts(verify_s=(0.06, 0.061), draft_s=0.0)
    assert choose_draft_length([1.0] * 7, short) == 1


def test_a_calibration_maps_confidence_to_acceptance():
    assert choose_draft_length([0.9] * 7, COSTS, acceptance=lambda c: 0.0) == 0


def test_bad_step_costs_are_refused():
    for verify, draft in [((), 0.1), ((0.0, 0.1), 0.1), ((0.1,), -1.0)]:
        with pytest.raises(ValueError, match="positive"):
            StepCosts(verify, draft)


# --- generation with a chosen draft length ------------------------------------------------------


def random_chooser(seed: int):
    """Any number of drafts, every step: the output must not depend on it."""
    rng = random.Random(seed)
    return lambda confidences: rng.randint(0, len(confidences))


@pytest.mark.parametrize("block_size", (2, 4, 8, 16))
def test_any_draft_length_is_lossless_on_a_real_target(block_size):
    import torch
    from dflash_fixtures import random_prompts, tiny_drafter, tiny_target

    from dflash_trt.dflash import generate as gen
    from dflash_trt.dflash.target import HFTarget

    model = tiny_target("llama")
    drafter = tiny_drafter(model, block_size=block_size, target_layer_ids=[0, 2])
    target = HFTarget(model, drafter.target_layer_ids)
    for i, prompt in enumerate(random_prompts(3, seed=2)):
        with torch.inference_mode():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24,
                                 do_sample=False)[0, len(prompt):].tolist()
        for chooser in (random_chooser(i), lambda c: choose_draft_length(c, COSTS)):
            tokens, stats = gen.generate(target, drafter, prompt, max_new_tokens=24,
                                         block_size=block_size, draft_length=chooser)
            assert tokens == ref
            assert all(1 <= n <= block_size for n in stats.acceptance_lengths)


def test_the_chosen_length_is_what_a_step_verifies():
    from dflash_fixtures import StubDrafter, chain_target

    from dflash_trt.dflash import generate as gen

    chosen = []

    def chooser(confidences):
        chosen.append(min(2, len(confidences)))
        return chosen[-1]

    steps = list(gen.generate_steps(chain_target(), StubDrafter(16), [3], max_new_tokens=30,
                                    block_size=8, draft_length=chooser))
    drafter_steps = [s for s in steps if s.draft_source == "dflash"]
    assert drafter_steps and [s.num_draft_tokens for s in drafter_steps] == chosen


def test_sampling_with_adaptive_draft_length_is_exact_by_chi_square():
    pytest.importorskip("scipy")
    import torch
    from dflash_fixtures import StubDrafter, StubTarget
    from test_generate import V, _bigram_chi_square, _markov

    from dflash_trt.dflash import generate as gen
    from dflash_trt.dflash.sampling import Sampler

    p_logits, q_logits = _markov(5)
    sampler = Sampler(1.0, 0, 1.0, torch.Generator().manual_seed(5))
    rng = random.Random(5)
    tokens, stats = gen.generate(
        StubTarget(p_logits), StubDrafter(V, logits=q_logits), [0], max_new_tokens=12000,
        block_size=8, sampler=sampler, draft_length=lambda c: rng.randint(0, len(c)))
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    assert _bigram_chi_square([0, *tokens], sampler.probs(p_logits)) > 1e-3


def test_a_confidence_based_draft_length_keeps_sampling_exact():
    """The chooser sees the drafter's confidences; they must not depend on the sampled drafts
    (verifying only high-q(d) drafts would bias the output: this test fails for that)."""
    pytest.importorskip("scipy")
    import itertools

    import torch
    from dflash_fixtures import StubDrafter, StubTarget
    from test_generate import V, _bigram_chi_square, _markov

    from dflash_trt.dflash import generate as gen
    from dflash_trt.dflash.sampling import Sampler

    p_logits, q_logits = _markov(7)
    q_logits[:, :] = q_logits[0]  # every position the same q: its peak decides nothing
    q_logits[1:, 0] += torch.arange(6) * 0.5  # ... except how sure the later positions are
    sampler = Sampler(1.0, 0, 1.0, torch.Generator().manual_seed(7))
    confident = lambda c: len(list(itertools.takewhile(lambda x: x > 0.45, c)))  # noqa: E731
    tokens, stats = gen.generate(
        StubTarget(p_logits), StubDrafter(V, logits=q_logits), [0], max_new_tokens=12000,
        block_size=8, sampler=sampler, draft_length=confident)
    assert 0 < stats.num_draft_tokens < 7 * len(stats.acceptance_lengths)  # it really chose
    assert _bigram_chi_square([0, *tokens], sampler.probs(p_logits)) > 1e-3


def test_expected_tokens_multiplies_the_position_rates():
    from dflash_trt.dflash.draft_length import expected_tokens

    assert expected_tokens([0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5], 2) == 1.0 + 0.5 + 0.25
    assert expected_tokens([0.5], 3) == 1.5  # positions past the profile add nothing


def test_schedule_keeps_full_drafts_while_verifying_is_free_and_cuts_them_when_it_is_not():
    from dflash_trt.dflash.draft_length import draft_len_schedule

    free = draft_len_schedule([0.9] * 7, lambda b, k: 1.0, 7, [1, 2, 4])
    assert free == {1: 7, 2: 7, 4: 7}
    linear = draft_len_schedule([0.5] * 7, lambda b, k: b * (k + 1), 7, [1, 2, 4])
    assert linear == {1: 7, 2: 0, 4: 0}  # (1 + 0.5 + ...) / (k + 1) is best at k = 0


def test_schedule_never_drafts_more_for_a_bigger_batch():
    from dflash_trt.dflash.draft_length import draft_len_schedule

    # a cost that would favour more drafts at batch 8 than at 4: clipped to batch 4's choice
    costs = {4: lambda k: 1 + k, 8: lambda k: 1.0}
    schedule = draft_len_schedule([0.6] * 7, lambda b, k: costs.get(b, lambda k: 1.0)(k), 7,
                                  [1, 4, 8])
    assert schedule[4] == 0 and schedule[8] == 0


def test_drafting_pays_only_where_the_expected_gain_beats_the_drafter_pass():
    from dflash_trt.dflash.draft_length import drafting_pays

    def verify(rows, width):  # a batch of 8 pays for every extra token per row; one row hardly
        return 0.1 + (0.001 if rows == 1 else 0.005 * rows) * width

    def draft(rows):
        return 0.01 * rows

    good, weak = [0.8] * 7, [0.2] * 7
    assert drafting_pays(good, 1, 1, verify, draft, 7)
    assert drafting_pays(weak, 1, 1, verify, draft, 7)
    assert drafting_pays(good, 8, 8, verify, draft, 7)
    assert not drafting_pays(weak, 8, 8, verify, draft, 7)
    assert not drafting_pays(good, 8, 1, verify, draft, 7)  # one drafting row of eight


def test_drafting_for_few_rows_pays_packed_where_padded_it_does_not():
    """8 rows, one drafting, drafts passing with chance 0.9: padded, its drafts widen all 8 rows
    (8 rows of k + 1 tokens); packed, only its own (a mean width of 1 + k / 8)."""
    from dflash_trt.dflash.draft_length import drafting_pays

    def verify_s(rows, width):  # 0.03 s a forward plus 0.002 s a token
        return 0.03 + 0.002 * rows * width

    args = dict(verify_s=verify_s, draft_s=lambda rows: 0.0, max_drafts=7)
    assert not drafting_pays([0.9] * 7, 8, 1, **args)
    assert drafting_pays([0.9] * 7, 8, 1, packed=True, **args)
    assert not drafting_pays([0.0] * 7, 8, 1, packed=True, **args)
