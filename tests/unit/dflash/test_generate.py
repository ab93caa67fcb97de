"""dflash.generate: lossless greedy decoding, acceptance bookkeeping, and lossless sampling."""

from __future__ import annotations

import pytest
import torch
from dflash_fixtures import (
    OracleDrafter,
    StubDrafter,
    StubTarget,
    chain_target,
    random_prompts,
    tiny_drafter,
    tiny_target,
)

from dflash_trt.dflash import generate as gen
from dflash_trt.dflash.sampling import Sampler
from dflash_trt.dflash.target import HFTarget

BLOCK_SIZES = (1, 2, 4, 8, 16)
NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def family_setup(request):
    """A tiny target, a random drafter, and HF generate's greedy output for 6 prompts."""
    model = tiny_target(request.param)
    prompts = random_prompts(5, seed=1)
    with torch.inference_mode():
        refs = [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS,
                               min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p):].tolist()
                for p in prompts]
    return model, prompts, refs


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_random_drafter_is_lossless_and_equals_hf_generate(family_setup, block_size):
    model, prompts, refs = family_setup
    drafter = tiny_drafter(model, block_size=max(block_size, 2), target_layer_ids=[0, 2])
    target = HFTarget(model, drafter.target_layer_ids)
    for prompt, ref in zip(prompts, refs, strict=True):
        tokens, stats = gen.generate(target, drafter, prompt, max_new_tokens=NEW_TOKENS,
                                     block_size=block_size)
        assert tokens == ref
        assert all(1 <= n <= block_size for n in stats.acceptance_lengths)


def test_draft_vocabulary_drafts_only_its_tokens_and_stays_lossless(family_setup, monkeypatch):
    model, prompts, refs = family_setup
    drafter = tiny_drafter(model, block_size=4, target_layer_ids=[0, 2])
    vocab = torch.arange(0, 128, 3)  # every third token id
    drafter.set_draft_vocab(vocab)
    target = HFTarget(model, drafter.target_layer_ids)
    hidden = torch.randn(3, model.config.hidden_size)
    torch.testing.assert_close(target.logits_rows(hidden, vocab), target.logits(hidden)[:, vocab])
    drafted = []
    real = gen.draft_block

    def spy(*args, **kwargs):
        drafts, q, confidence = real(*args, **kwargs)
        drafted.extend(drafts)
        return drafts, q, confidence

    monkeypatch.setattr(gen, "draft_block", spy)
    for prompt, ref in zip(prompts, refs, strict=True):
        tokens, _ = gen.generate(target, drafter, prompt, max_new_tokens=NEW_TOKENS, block_size=4)
        assert tokens == ref
    assert drafted and set(drafted) <= set(vocab.tolist())


@pytest.mark.parametrize("block_size", BLOCK_SIZES[1:])
def test_oracle_drafter_with_every_acceptance_length_is_lossless(family_setup, block_size):
    """Drafts right for 0..B-1 positions in turn: the target cache is cropped at every length."""
    model, prompts, refs = family_setup
    target = HFTarget(model, [0])
    for prompt, ref in zip(prompts, refs, strict=True):
        oracle = OracleDrafter(model, prompt + ref, block_size)
        tokens, stats = gen.generate(target, oracle, prompt, max_new_tokens=NEW_TOKENS,
                                     block_size=block_size)
        assert tokens == ref
        assert all(1 <= n <= block_size for n in stats.acceptance_lengths)
        assert set(range(1, min(block_size, 6) + 1)) <= set(stats.acceptance_lengths)
    assert stats.num_accepted_draft_tokens == sum(stats.acceptance_lengths) - len(
        stats.acceptance_lengths)


def test_prompt_lookup_is_lossless_and_drafts_where_the_ngram_recurs(family_setup):
    model, prompts, refs = family_setup
    drafter = tiny_drafter(model, block_size=4, target_layer_ids=[0, 2])
    target = HFTarget(model, drafter.target_layer_ids)
    lookup_steps = 0
    for prompt in prompts:
        prompt = prompt * 3  # the prompt repeats itself, as answers that copy their prompt do
        with torch.inference_mode():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):]
        tokens, stats = gen.generate(target, drafter, prompt, max_new_tokens=NEW_TOKENS,
                                     block_size=4, prompt_lookup=True)
        assert tokens == ref.tolist()
        assert all(1 <= n <= 4 for n in stats.acceptance_lengths)
        lookup_steps += stats.num_lookup_steps
    assert lookup_steps > 0


def test_prompt_lookup_skips_the_drafter_when_it_drafts(monkeypatch):
    target = chain_target()  # greedy: t -> t + 1 (mod 16)
    drafter = StubDrafter(16, correct=0)  # always wrong
    calls = []
    real = gen.draft_block
    monkeypatch.setattr(gen, "draft_block", lambda *a, **k: calls.append(1) or real(*a, **k))
    prompt = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0]  # the chain, once around
    tokens, stats = gen.generate(target, drafter, prompt, max_new_tokens=13, block_size=4,
                                 prompt_lookup=True)
    assert tokens == [(1 + i) % 16 for i in range(13)]
    assert stats.acceptance_lengths == [4, 4, 4]  # every lookup draft right, the drafter unused
    assert stats.num_lookup_steps == 3 and not calls


def _alternating_lookup(monkeypatch, wrong: bool = False, period: int = 2):
    """Prompt lookup that finds nothing on every `period`-th call and drafts (right, or `wrong`)
    on the others."""
    calls = []

    def lookup(history, k):
        calls.append(k)
        if len(calls) % period == 1:
            return []
        right = [(history[-1] + j) % 16 for j in range(1, k + 1)]  # the chain target's tokens
        return [(t + 1) % 16 for t in right] if wrong else right

    monkeypatch.setattr(gen, "lookup_drafts", lookup)


def test_drafter_context_spans_the_steps_lookup_drafted(monkeypatch):
    _alternating_lookup(monkeypatch)
    target, drafter = chain_target(), StubDrafter(16, correct=2)
    steps = list(gen.generate_steps(target, drafter, [1, 2, 3, 4, 5], max_new_tokens=40,
                                    block_size=8, prompt_lookup=True))
    sources = [s.draft_source for s in steps[1:]]
    assert "lookup" in sources and "dflash" in sources
    # The drafter's first pass sees the prompt; each later one, every token accepted since its
    # previous pass, including those of the lookup steps in between.
    expected, since = [5], 0
    for step in steps[1:]:
        if step.draft_source == "dflash" and since:
            expected.append(since)
            since = 0
        since += len(step.token_ids)
    assert drafter.context_lengths == expected


def test_backoff_rests_the_drafter_only_for_its_own_misses(monkeypatch):
    # Lookup misses twice in a row between drafter steps; the drafter always hits: it must never
    # rest (counting lookup misses would rest it after every second one).
    _alternating_lookup(monkeypatch, wrong=True, period=3)
    plain, _ = gen.generate(chain_target(), None, [3], max_new_tokens=60, block_size=1)
    steps = list(gen.generate_steps(chain_target(), StubDrafter(16), [3], max_new_tokens=60,
                                    block_size=4, backoff=True, prompt_lookup=True))
    assert [t for s in steps for t in s.token_ids] == plain
    assert None not in [s.draft_source for s in steps[1:-1]]  # no undrafted (resting) step


def test_lookup_drafts_while_the_drafter_rests():
    # The drafter never hits; the chain repeats after 16 tokens, so lookup then always hits.
    target = chain_target()
    plain, _ = gen.generate(chain_target(), None, [3], max_new_tokens=80, block_size=1)
    tokens, stats = gen.generate(target, StubDrafter(16, correct=0), [3], max_new_tokens=80,
                                 block_size=4, backoff=True, prompt_lookup=True)
    assert tokens == plain
    assert stats.num_lookup_steps >= 15  # the last 60 tokens, 4 per step
    assert stats.acceptance_lengths[-10:] == [4] * 9 + stats.acceptance_lengths[-1:]


def test_plain_decoding_needs_no_features(family_setup):
    model, prompts, refs = family_setup
    target = HFTarget(model, [1])
    calls = []
    target.forward = (lambda f: lambda ids, cache, capture: calls.append(capture) or f(
        ids, cache, capture))(target.forward)
    tokens, _ = gen.generate(target, None, prompts[0], max_new_tokens=5, block_size=8)
    assert tokens == refs[0][:5]
    assert calls == [False] * 5


@pytest.mark.parametrize(("correct", "block_size", "expected"), [
    (10**9, 4, 4), (10**9, 8, 8), (0, 4, 1), (0, 16, 1), (2, 8, 3), (5, 8, 6)])
def test_stub_acceptance_always_never_partly(correct, block_size, expected):
    target, drafter = chain_target(), StubDrafter(16, correct=correct)
    tokens, stats = gen.generate(target, drafter, [3], max_new_tokens=40, block_size=block_size)
    assert tokens == [(3 + i) % 16 for i in range(1, 41)]  # lossless whatever the drafter says
    assert stats.acceptance_lengths[:-1] == [expected] * (len(stats.acceptance_lengths) - 1)
    assert 1 <= stats.acceptance_lengths[-1] <= expected
    assert stats.num_draft_tokens == sum(target.forward_lengths[1:]) - len(target.forward_lengths[1:])


def test_drafter_receives_exactly_the_accepted_context():
    target, drafter = chain_target(), StubDrafter(16, correct=2)
    _, stats = gen.generate(target, drafter, [1, 2, 3, 4, 5], max_new_tokens=30, block_size=8)
    # First the whole prompt, then the accepted tokens of each step (last token + accepted drafts).
    assert drafter.context_lengths[0] == 5
    assert drafter.context_lengths[1:] == stats.acceptance_lengths[:len(drafter.context_lengths) - 1]


@pytest.mark.parametrize("max_new", [1, 2, 3, 7, 16, 17, 33])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_exact_max_new_tokens(max_new, block_size):
    tokens, stats = gen.generate(chain_target(), StubDrafter(16), [0], max_new_tokens=max_new,
                                 block_size=block_size)
    assert len(tokens) == max_new
    assert stats.finish_reason == "length"


@pytest.mark.parametrize("num_draft_tokens", [0, 1, 3])
def test_num_draft_tokens_limits_the_block(num_draft_tokens):
    target = chain_target()
    tokens, stats = gen.generate(target, StubDrafter(16), [0], max_new_tokens=20, block_size=8,
                                 num_draft_tokens=num_draft_tokens)
    assert tokens == [i % 16 for i in range(1, 21)]
    assert max(target.forward_lengths[1:]) == num_draft_tokens + 1


def test_stop_token_ends_generation_inside_an_accepted_block():
    tokens, stats = gen.generate(chain_target(), StubDrafter(16), [0], max_new_tokens=40,
                                 block_size=8, stop_token_ids=[11])
    assert tokens == list(range(1, 12))
    assert stats.finish_reason == "eos"


def test_stop_token_as_first_token():
    tokens, stats = gen.generate(chain_target(), StubDrafter(16), [4], max_new_tokens=9,
                                 block_size=4, stop_token_ids=[5])
    assert (tokens, stats.finish_reason) == ([5], "eos")


# --- sampling ----------------------------------------------------------------------------------

V = 6


def _markov(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p_logits = torch.randn(V, V, generator=g) * 1.5  # target: next-token logits per previous token
    q_logits = torch.randn(7, V, generator=g) * 1.5  # drafter: fixed logits per block position
    q_logits[:, 0] += 2.0  # the drafter over-proposes token 0, so rejections matter
    return p_logits, q_logits


def _bigram_chi_square(tokens: list[int], expected_probs: torch.Tensor) -> float:
    """p-value that bigram counts follow expected_probs[prev] (Pearson, summed over rows)."""
    counts = torch.zeros(V, V)
    for a, b in zip(tokens, tokens[1:], strict=False):
        counts[a, b] += 1
    expected = counts.sum(dim=1, keepdim=True) * expected_probs
    keep = expected > 0
    stat = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    dof = int(keep.sum()) - V
    from scipy.stats import chi2

    return float(chi2.sf(stat, dof))


def _sample_tokens(temperature: float, top_k: int, seed: int,
                   draft_vocab: tuple[int, ...] | None = None,
                   prompt_lookup: bool = False) -> tuple[list[int], torch.Tensor]:
    p_logits, q_logits = _markov(seed)
    target = StubTarget(p_logits)
    drafter = StubDrafter(V, logits=q_logits)
    if draft_vocab is not None:
        drafter.draft_vocab = torch.tensor(draft_vocab)
    sampler = Sampler(temperature, top_k, 1.0, torch.Generator().manual_seed(seed))
    tokens, stats = gen.generate(target, drafter, [0], max_new_tokens=12000, block_size=8,
                                 sampler=sampler, prompt_lookup=prompt_lookup)
    assert stats.num_accepted_draft_tokens > 0 and stats.num_accepted_draft_tokens < stats.num_draft_tokens
    if prompt_lookup:  # 6 tokens: nearly every n-gram occurred before, so lookup drafts
        assert stats.num_lookup_steps > len(stats.acceptance_lengths) // 2
    return [0, *tokens], sampler.probs(p_logits)


@pytest.mark.parametrize(("temperature", "top_k", "draft_vocab", "prompt_lookup"),
                         [(1.0, 0, None, False), (0.7, 4, None, False),
                          (1.0, 0, (0, 2, 3, 5), False), (1.0, 0, None, True)])
def test_sampling_is_lossless_by_chi_square(temperature, top_k, draft_vocab, prompt_lookup):
    """Also with a draft vocabulary (q is 0 outside it) and with prompt-lookup drafts (q one-hot):
    the output still follows the target."""
    pytest.importorskip("scipy")
    tokens, expected = _sample_tokens(temperature, top_k, seed=3, draft_vocab=draft_vocab,
                                      prompt_lookup=prompt_lookup)
    assert _bigram_chi_square(tokens, expected) > 1e-3


def test_chi_square_rejects_a_sampler_that_resamples_from_p(monkeypatch):
    """The check has teeth: resampling from p instead of the residual (p - q)+ is caught."""
    pytest.importorskip("scipy")

    def broken(logits, drafts, q, sampler):
        for i, d in enumerate(drafts):
            p = sampler.probs(logits[i])
            if sampler.uniform() * q[i, d] < p[d]:
                continue
            return i, int(sampler.draw(p[None])[0])
        return len(drafts), int(sampler.draw(sampler.probs(logits[len(drafts)])[None])[0])

    monkeypatch.setattr(gen, "accept_sampled", broken)
    tokens, expected = _sample_tokens(1.0, 0, seed=3)
    assert _bigram_chi_square(tokens, expected) < 1e-6


def test_seeded_sampling_is_reproducible_on_a_real_target(family_setup):
    model, prompts, _ = family_setup
    drafter = tiny_drafter(model, block_size=4)
    target = HFTarget(model, drafter.target_layer_ids)

    def run(seed):
        sampler = Sampler(0.9, 20, 0.95, torch.Generator().manual_seed(seed))
        return gen.generate(target, drafter, prompts[0], max_new_tokens=20, block_size=4,
                            sampler=sampler)[0]

    first = run(5)
    assert len(first) == 20
    assert run(5) == first
    assert run(6) != first


def test_top_k_and_top_p_filtering():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert (Sampler(1.0, top_k=2).probs(logits)[0, 2:] == 0).all()
    probs = torch.softmax(logits, dim=-1)[0]  # [0.644, 0.237, 0.087, 0.032]
    kept = Sampler(1.0, top_p=0.85).probs(logits)[0]
    assert (kept[:2] > 0).all() and (kept[2:] == 0).all()  # 0.644 < 0.85 <= 0.881
    assert torch.allclose(kept[:2], probs[:2] / probs[:2].sum())
    assert Sampler(0.0).sample(logits).item() == 0


def test_backoff_rests_a_drafter_that_never_hits_and_stays_lossless():
    from dflash_trt.dflash.generate import BACKOFF_MAX

    target = chain_target()
    plain, _ = gen.generate(target, None, [3], max_new_tokens=120, block_size=1)
    tokens, stats = gen.generate(target, StubDrafter(16, correct=0), [3], max_new_tokens=120,
                             block_size=4, backoff=True)
    assert tokens == plain
    no_backoff_target = chain_target()
    _, stats_fixed = gen.generate(no_backoff_target, StubDrafter(16, correct=0), [3],
                              max_new_tokens=120, block_size=4)
    # Without back-off every decoding step verifies 3 rejected drafts; with it, most steps are
    # plain one-token forwards, and rests grow up to BACKOFF_MAX.
    assert stats_fixed.num_draft_tokens > 2.9 * len(stats_fixed.acceptance_lengths)
    assert stats.num_draft_tokens < stats_fixed.num_draft_tokens / 4
    assert target.forward_lengths.count(1) > len(target.forward_lengths) * 3 // 4
    assert BACKOFF_MAX >= 8


@pytest.mark.parametrize("correct", [1, 10**9])
def test_backoff_never_rests_a_drafter_that_hits(correct):
    runs = []
    for backoff in (False, True):
        target = chain_target()
        tokens, stats = gen.generate(target, StubDrafter(16, correct=correct), [5],
                                 max_new_tokens=60, block_size=4, backoff=backoff)
        runs.append((tokens, stats.acceptance_lengths, target.forward_lengths))
    assert runs[0] == runs[1]


def test_backoff_is_lossless_on_a_real_target(family_setup):
    model, prompts, refs = family_setup
    drafter = tiny_drafter(model, block_size=4, target_layer_ids=[0, 2])
    for ids, ref in zip(prompts, refs, strict=True):
        tokens, _ = gen.generate(HFTarget(model, drafter.target_layer_ids), drafter, ids,
                             max_new_tokens=NEW_TOKENS, block_size=4, backoff=True)
        assert tokens == ref


# --- bad words ---------------------------------------------------------------------------------

def test_banned_next_matches_the_word_prefix():
    from dflash_trt.dflash.sampling import banned_next

    assert banned_next([1, 2, 3], [(7,), (3, 9), (2, 9), (1, 2, 3, 8)]) == [7, 9, 8]
    assert banned_next([], [(3, 9), (5,)]) == [5]


@pytest.mark.parametrize("block_size", [1, 4, 8])
def test_bad_words_are_never_produced_and_speculation_stays_lossless(family_setup, block_size):
    model, prompts, refs = family_setup
    drafter = tiny_drafter(model, block_size=max(block_size, 2), target_layer_ids=[0, 2])
    target = HFTarget(model, drafter.target_layer_ids)
    for prompt, ref in zip(prompts, refs, strict=True):
        # ban the plain output's first token outright and its 3rd-4th tokens as a pair
        bad = ((ref[0],), (ref[2], ref[3]))
        plain, _ = gen.generate(target, drafter, prompt, max_new_tokens=NEW_TOKENS,
                                block_size=1, bad_words=bad)
        spec, _ = gen.generate(target, drafter, prompt, max_new_tokens=NEW_TOKENS,
                               block_size=block_size, bad_words=bad)
        assert spec == plain != ref
        assert ref[0] not in plain
        assert all(plain[i:i + 2] != [ref[2], ref[3]] for i in range(len(plain) - 1))


def test_sampling_with_a_bad_word_follows_the_masked_target_by_chi_square():
    pytest.importorskip("scipy")
    from dflash_trt.dflash.sampling import without

    p_logits, q_logits = _markov(5)
    sampler = Sampler(1.0, 0, 1.0, torch.Generator().manual_seed(5))
    tokens, stats = gen.generate(StubTarget(p_logits), StubDrafter(V, logits=q_logits), [0],
                                 max_new_tokens=12000, block_size=8, sampler=sampler,
                                 bad_words=((2,), (0, 1)))
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    seq = [0, *tokens]
    assert 2 not in seq and all(seq[i:i + 2] != [0, 1] for i in range(len(seq) - 1))
    masked = torch.stack([without(p_logits[a], [2, 1] if a == 0 else [2]) for a in range(V)])
    assert _bigram_chi_square(seq, sampler.probs(masked)) > 1e-3
