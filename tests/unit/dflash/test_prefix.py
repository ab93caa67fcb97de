"""dflash.prefix: kept prompts' keys and values start later prompts that share their beginning,
and the batch's output stays each request's own plain greedy output."""

from __future__ import annotations

import pytest
import torch
from dflash_fixtures import random_prompts, tiny_drafter, tiny_target
from test_batch import run

from dflash_trt.dflash import generate as gen
from dflash_trt.dflash.batch import BatchDecoder, Request
from dflash_trt.dflash.prefix import PrefixStore, common_prefix
from dflash_trt.dflash.target import HFTarget


def saved(n: int) -> list:
    return [[(torch.zeros(1, n, 1), torch.zeros(1, n, 1))]]


def test_common_prefix_counts_the_shared_start():
    assert common_prefix([1, 2, 3, 4], [1, 2, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([7], [1]) == 0
    assert common_prefix([], [1]) == 0


def test_a_match_leaves_the_prompts_last_token_to_compute_and_ignores_short_ones():
    store = PrefixStore(budget=100)
    kept = list(range(20))
    store.keep(kept, saved)
    assert store.match(kept)[0] == 19  # its last token's logits need a forward
    assert store.match([*range(12), 99, 98])[0] == 12
    assert store.match([*range(12)])[0] == 11
    assert store.match([*range(PrefixStore.MIN_TOKENS - 1), 99, 98]) == (0, None)
    assert store.match([5, 6, 7, 8, 9, 10, 11, 12, 13]) == (0, None)  # shared, but not the start
    assert store.reused == 19 + 12 + 11


def test_the_store_keeps_to_its_budget_dropping_the_least_recently_used():
    store = PrefixStore(budget=30)
    a, b, c = [[k] * 12 for k in (1, 2, 3)]
    store.keep(a, saved)
    store.keep(b, saved)
    assert store.match([1] * 13)[0] == 12  # a is now the most recently used
    store.keep(c, saved)  # 36 tokens > 30: b goes
    assert (len(store), store.tokens) == (2, 24)
    assert store.match([2] * 13) == (0, None)
    assert store.match([1] * 13)[0] == 12 and store.match([3] * 13)[0] == 12


def test_a_prompt_kept_already_or_over_the_budget_is_not_copied_again():
    store, copies = PrefixStore(budget=16), []

    def take(n):
        copies.append(n)
        return saved(n)

    store.keep(list(range(10)), take)
    store.keep(list(range(10)), take)
    store.keep(list(range(17)), take)  # longer than the whole budget
    store.keep(list(range(4)), take)  # shorter than MIN_TOKENS
    assert copies == [10] and store.tokens == 10


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def shared(request):
    """A float64 tiny target and drafter; prompts that share a 20-token start (a system turn),
    one that repeats another and one that continues another (a second turn)."""
    model = tiny_target(request.param).double()
    drafter = tiny_drafter(model, block_size=4, target_layer_ids=[0, 2]).double()
    start = random_prompts(1, seed=7, low=20, high=21)[0]
    tails = random_prompts(4, seed=8, low=3, high=15)
    prompts = [start + t for t in tails]
    prompts += [prompts[1], prompts[2] + [5, 6, 7]]
    lengths = [12, 20, 7, 16, 9, 14]
    refs = [gen.generate(HFTarget(model), None, p, max_new_tokens=n, block_size=1)[0]
            for p, n in zip(prompts, lengths, strict=True)]
    return model, drafter, prompts, lengths, refs


@pytest.mark.parametrize("packed", [True, False])
def test_batched_greedy_with_kept_prefixes_equals_each_requests_plain_greedy(shared, packed):
    model, drafter, prompts, lengths, refs = shared
    decoder = BatchDecoder(HFTarget(model, drafter.target_layer_ids), drafter, block_size=4,
                           max_rows=2, max_seq_len=128, backoff=False, packed=packed,
                           prefill_chunk=8, prefix_tokens=1000)
    requests = [Request(p, n) for p, n in zip(prompts, lengths, strict=True)]
    assert run(decoder, requests, arrive=[0, 0, 1, 1, 2, 2]) == refs
    # the first two computed their prompts; every later one reused at least the shared start
    assert decoder.prefixes.reused >= 4 * 20


def test_a_reused_prefix_leaves_both_caches_as_the_prompts_own_forward_does(shared):
    """The target's and the drafter's keys and values of a prompt that reused a kept start equal
    those of a batch that computed all of it (float64, to 1e-12)."""
    model, drafter, prompts, _, _ = shared

    def caches_after(prefix_tokens: int) -> list:
        """The second prompt's caches, in a slot of its own (the first prompt's row stays)."""
        decoder = BatchDecoder(HFTarget(model, drafter.target_layer_ids), drafter, block_size=4,
                               max_rows=2, max_seq_len=128, prefix_tokens=prefix_tokens)
        for prompt in prompts[:2]:
            row = decoder.add(Request(prompt, 40))
            while row.token is None:
                decoder.step()
        assert decoder.prefixes is None or decoder.prefixes.reused == 20
        return [cache.take(1, len(prompts[1])) for cache in decoder._caches()]

    reused, computed = caches_after(1000), caches_after(0)
    pairs = [(a, b) for ours, theirs in zip(reused, computed, strict=True)
             for layer_a, layer_b in zip(ours, theirs, strict=True)
             for a, b in zip(layer_a, layer_b, strict=True)]
    assert len(pairs) == 2 * (4 + 1)  # keys and values of 4 target layers and 1 drafter layer
    for a, b in pairs:
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_a_longer_sequence_replaces_the_kept_ones_it_starts_with():
    store = PrefixStore(budget=100)
    store.keep(list(range(10)), saved)
    store.keep([*range(10), 50, 51], saved)
    store.keep([*range(9), 77], saved)  # shares 9 but does not start with a kept one
    assert (len(store), store.tokens) == (2, 22)
    assert store.match([*range(10), 50, 51, 52])[0] == 12


@pytest.mark.parametrize("drafting", [True, False])
def test_a_conversations_next_turn_reuses_the_finished_turn(shared, drafting):
    """A finished request's prompt and answer are kept: the next turn (prompt + answer + a new
    user turn) computes only what follows them, and its output is still plain greedy's."""
    model, drafter, prompts, _, _ = shared
    first = prompts[0]
    answer = gen.generate(HFTarget(model), None, first, max_new_tokens=10, block_size=1)[0]
    second = [*first, *answer, 9, 10, 11]
    ref = gen.generate(HFTarget(model), None, second, max_new_tokens=10, block_size=1)[0]
    target = HFTarget(model, drafter.target_layer_ids if drafting else None)
    decoder = BatchDecoder(target, drafter if drafting else None, block_size=4 if drafting else 1,
                           max_rows=1, max_seq_len=128, backoff=False, prefix_tokens=1000)
    assert run(decoder, [Request(first, 10)], arrive=[0]) == [answer]
    assert decoder.prefixes.reused == 0
    assert run(decoder, [Request(second, 10)], arrive=[0]) == [ref]
    # the whole first turn but its last token, which no forward has taken yet; drafting, the
    # drafter's cache may lack the last step's context
    reused = decoder.prefixes.reused
    assert reused == len(first) + len(answer) - 1 if not drafting else \
        len(first) < reused <= len(first) + len(answer) - 1


def test_sampled_output_with_kept_prefixes_equals_it_without_seed_by_seed(shared):
    """Sampling (temperature 1, each request its own seed) draws the same tokens whether a
    request's prompt start was reused or computed (float64): reuse leaves every logit as it was,
    so the batch's chi-square tests without reuse (test_batch) hold with it too."""
    from dflash_trt.dflash.sampling import Sampler

    model, drafter, prompts, lengths, _ = shared

    def sampled(prefix_tokens: int) -> list[list[int]]:
        decoder = BatchDecoder(HFTarget(model, drafter.target_layer_ids), drafter, block_size=4,
                               max_rows=2, max_seq_len=128, backoff=False, prefill_chunk=8,
                               prefix_tokens=prefix_tokens)
        requests = [Request(p, n, Sampler(1.0, 0, 1.0, torch.Generator().manual_seed(seed)))
                    for seed, (p, n) in enumerate(zip(prompts, lengths, strict=True))]
        out = run(decoder, requests, arrive=[0, 0, 1, 1, 2, 2])
        assert prefix_tokens == 0 or decoder.prefixes.reused >= 4 * 20
        return out

    with_reuse, without = sampled(1000), sampled(0)
    assert with_reuse == without
    assert [len(o) for o in with_reuse] == lengths  # no stop tokens: every request ran its length
