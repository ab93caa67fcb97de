"""dflash.batch: batched DFlash equals each request's own plain decoding, rows come and go."""

from __future__ import annotations

import pytest
import torch
from dflash_fixtures import VOCAB, random_prompts, tiny_drafter, tiny_target

from dflash_trt.dflash import generate as gen
from dflash_trt.dflash.batch import BatchDecoder, Request
from dflash_trt.dflash.policy import choose_counts, choose_width, draft_chooser
from dflash_trt.dflash.sampling import Sampler
from dflash_trt.dflash.target import HFTarget


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def setup(request):
    """A float64 tiny target (exact: no near-ties), a random drafter, plain greedy references."""
    model = tiny_target(request.param).double()
    drafter = tiny_drafter(model, block_size=4, target_layer_ids=[0, 2]).double()
    target = HFTarget(model, drafter.target_layer_ids)
    prompts = random_prompts(6, seed=4, low=2, high=40)
    lengths = [5, 30, 17, 1, 24, 9]
    refs = [gen.generate(HFTarget(model), None, p, max_new_tokens=n, block_size=1)[0]
            for p, n in zip(prompts, lengths, strict=True)]
    return target, drafter, prompts, lengths, refs


def run(decoder: BatchDecoder, requests: list[Request], arrive: list[int]) -> list[list[int]]:
    """Requests join at their step (arrive), at most max_rows at once; tokens per request."""
    out = [[] for _ in requests]
    rows, waiting, step = {}, list(range(len(requests))), 0
    while waiting or rows:
        for i in [i for i in waiting if arrive[i] <= step]:
            if len(decoder.rows) < decoder.max_rows:
                rows[id(decoder.add(requests[i]))] = i
                waiting.remove(i)
        for row, s in decoder.step():
            out[rows[id(row)]].extend(s.token_ids)
        for row in [r for r in decoder.rows if r.finish is not None]:
            decoder.remove(row)
            del rows[id(row)]
        step += 1
    return out


@pytest.mark.parametrize("chunk", [8, 64])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("max_rows", [1, 3, 6])
def test_batched_greedy_equals_each_requests_plain_greedy(setup, max_rows, packed, chunk,
                                                          monkeypatch):
    """Rows in their prompt, rows near their end (fewer drafts left) and rows drafting a whole
    block share forwards: packed (each row its own tokens, prompt chunks of up to `chunk` tokens
    in all in the same forward) or padded to the widest (prompts in forwards of their own)."""
    from dflash_trt.dflash.slots import SlotCache

    target, drafter, prompts, lengths, refs = setup
    packs = []
    monkeypatch.setattr(SlotCache, "packed", lambda self, *a, f=SlotCache.packed: (
        packs.append(a), f(self, *a))[1])
    decoder = BatchDecoder(target, drafter, block_size=4, max_rows=max_rows, max_seq_len=128,
                           backoff=False, prefill_chunk=chunk, packed=packed)
    requests = [Request(p, n) for p, n in zip(prompts, lengths, strict=True)]
    assert run(decoder, requests, arrive=[0, 0, 2, 3, 3, 7]) == refs
    assert bool(packs) == (packed and max_rows > 1)
    if packed and max_rows > 1:  # prompt chunks (> 4 tokens) rode in verify forwards (<= 4)
        assert any(max(a[2]) > 4 and any(1 <= c <= 4 for c in a[2]) for a in packs)
        assert any(max(a[2]) > 16 for a in packs) == (chunk > 16)


class BatchOracle(torch.nn.Module):
    """A drafter that knows each slot's reference continuation: at its c-th pass it drafts
    c % block correct tokens and then wrong ones, so every acceptance length occurs in a batch."""

    draft_vocab = None

    def __init__(self, target, sequences: list[list[int]], block_size: int):
        super().__init__()
        self.sequences, self.block_size = sequences, block_size
        self.mask_token_id = VOCAB - 1
        self.rows = target.model.get_output_embeddings().weight.detach()  # (V, H)
        self.calls = 0

    def new_slot_cache(self, rows, capacity):
        from dflash_trt.dflash.slots import SlotCache

        return SlotCache(0, rows, capacity)

    def forward_rows(self, noise_embedding, target_hidden, context_lengths, view):
        if noise_embedding is None:
            return None
        n, width = noise_embedding.shape[:2]
        out = self.rows.new_zeros(n, width, self.rows.shape[1])
        correct = self.calls % self.block_size
        self.calls += 1
        for r in range(n):
            start = view.starts[r] + context_lengths[r]  # the block's first position
            for j in range(1, width):
                seq = self.sequences[r]
                token = seq[start + j] if start + j < len(seq) else 0
                out[r, j] = self.rows[token if j <= correct else (token + 1) % (VOCAB - 1)]
        return out


def test_batched_rows_accept_every_length_and_stay_exact(setup):
    """Drafts that are partly right in every row: each row's caches are cropped to its own
    accepted length in shared forwards, and the output is still each row's plain greedy."""
    target, _, prompts, _, _ = setup
    plain = HFTarget(target.model)
    refs = [gen.generate(plain, None, p, max_new_tokens=40, block_size=1)[0] for p in prompts]
    oracle = BatchOracle(target, [p + r for p, r in zip(prompts, refs, strict=True)], 4)
    decoder = BatchDecoder(target, oracle, block_size=4, max_rows=6, max_seq_len=128,
                           backoff=False)
    rows = [decoder.add(Request(p, 40)) for p in prompts]
    steps = decoder.prefill()
    while any(row.finish is None for row in decoder.rows):
        steps += decoder.decode()
    assert [[t for row, s in steps if row is mine for t in s.token_ids] for mine in rows] == refs
    assert {s.num_accepted_draft_tokens for _, s in steps if s.num_draft_tokens == 3} \
        == {0, 1, 2, 3}


def test_a_rows_first_token_comes_before_the_next_rows_prefill(setup):
    """prefill(each=...) hands each row its first token straight after that row's own forward."""
    target, drafter, prompts, _, refs = setup
    decoder = BatchDecoder(target, drafter, block_size=4, max_rows=3, max_seq_len=128)
    rows = [decoder.add(Request(p, 5)) for p in prompts[:3]]
    events, forward = [], target.forward

    def logged_forward(ids, cache, capture):
        events.append("forward")
        return forward(ids, cache, capture)

    target.forward = logged_forward
    try:
        steps = decoder.prefill(each=lambda row, step: events.append(rows.index(row)))
    finally:
        del target.forward
    assert events == ["forward", 0, "forward", 1, "forward", 2]
    assert [s.token_ids for _, s in steps] == [[ref[0]] for ref in refs[:3]]


def test_bad_words_and_stops_hold_per_row(setup):
    target, drafter, prompts, _, _ = setup
    model = target.model
    plain = HFTarget(model)
    words, stop = [[5], [7, 9]], 11
    refs = [gen.generate(plain, None, p, max_new_tokens=20, block_size=1, bad_words=words,
                         stop_token_ids=[stop])[0] for p in prompts[:3]]
    decoder = BatchDecoder(target, drafter, block_size=4, max_rows=3, max_seq_len=128)
    requests = [Request(p, 20, stop_token_ids=[stop], bad_words=words) for p in prompts[:3]]
    assert run(decoder, requests, arrive=[0, 1, 1]) == refs


V = 6


def _bigram_p_value(sequences: list[list[int]], probs: torch.Tensor) -> float:
    from scipy.stats import chi2

    counts = torch.zeros(V, V)
    for seq in sequences:
        for a, b in zip(seq, seq[1:], strict=False):
            counts[a, b] += 1
    expected = counts.sum(dim=1, keepdim=True) * probs
    keep = expected > 0
    stat = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    return float(chi2.sf(stat, int(keep.sum()) - V))


@pytest.mark.parametrize("lookup", [False, True])
def test_batched_sampling_follows_the_target_by_chi_square(lookup):
    """Four rows sampling side by side (own seeds, shared forwards) follow the target."""
    pytest.importorskip("scipy")
    from dflash_fixtures import StubDrafter, StubTarget

    g = torch.Generator().manual_seed(5)
    p_logits = torch.randn(V, V, generator=g) * 1.5
    q_logits = torch.randn(7, V, generator=g) * 1.5
    q_logits[:, 0] += 2.0  # over-proposed: rejections matter
    target, drafter = StubTarget(p_logits), StubDrafter(V, logits=q_logits)
    decoder = BatchDecoder(target, drafter, block_size=8, max_rows=4, max_seq_len=5000,
                           prompt_lookup=lookup)
    seqs = [[0] for _ in range(4)]
    for seed in range(4):
        decoder.add(Request([0], 3000, Sampler(1.0, 0, 1.0, torch.Generator().manual_seed(seed))))
    steps = decoder.prefill()
    while any(row.finish is None for row in decoder.rows):
        steps += decoder.decode()
    by_row = {id(row): i for i, row in enumerate(decoder.rows)}
    for row, step in steps:
        seqs[by_row[id(row)]].extend(step.token_ids)
    assert all(len(s) == 3001 for s in seqs)
    accepted = sum(s.num_accepted_draft_tokens for _, s in steps)
    assert 0 < accepted < sum(s.num_draft_tokens for _, s in steps)
    assert _bigram_p_value(seqs, Sampler(1.0).probs(p_logits)) > 1e-3


def test_choose_width_picks_none_when_drafts_never_pass_and_all_when_they_do():
    def cost(rows, width):
        return 0.1 * rows + 0.01 * rows * width

    assert choose_width([[0.0] * 7] * 4, cost) == 1
    assert choose_width([[1.0] * 7] * 4, cost) == 8
    assert choose_width([[1.0] * 3, [0.0] * 7], cost) == 4  # the sure row sets the width
    # A batch costs more per width than one row: the same drafts earn a shorter verify.
    conf = [[0.6] * 7]
    assert choose_width(conf * 8, lambda n, w: 0.1 + 0.05 * n * w) \
        < choose_width(conf, lambda n, w: 0.1 + 0.05 * n * w)


def test_a_step_without_the_drafter_pass_chooses_its_width_without_its_cost():
    """8 rows, the CPU default's measured costs (ms): verify 92 at width 1, 115 at 2, a drafter
    pass 25. A draft passing with chance 0.22 pays for width 2 only beside a drafter pass already
    paid (10.4 tokens in 140 ms against 8 in 117), not in a step of lookup drafts alone (10.4 in
    115 against 8 in 92)."""
    def verify_s(rows, width):
        return {1: 92.0, 2: 115.0}[width]

    def step_s(rows, width):
        return 25.0 + verify_s(rows, width)

    choose = draft_chooser(step_s, verify_s, packed=False)
    assert choose([[0.22]] * 8, True) == [1] * 8
    assert choose([[0.22]] * 8, False) == [0] * 8


def test_choose_counts_spends_a_packed_forwards_tokens_on_the_likeliest_drafts():
    """Packed, a row's drafts cost their own tokens: a sure row verifies all its drafts while the
    hopeless rows beside it verify none (padded, they would all pay the sure row's width)."""
    def cost(rows, width):  # seconds of rows * width tokens: 0.1 per forward, 0.01 per token
        return 0.1 + 0.01 * rows * width

    assert choose_counts([[0.0] * 7] * 4, cost) == [0] * 4
    assert choose_counts([[1.0] * 7] * 4, cost) == [7] * 4
    assert choose_counts([[0.05] * 7, [1.0] * 3, [0.05] * 7], cost) == [0, 3, 0]
    # A row's drafts are taken in order: the third only after the second.
    assert choose_counts([[0.9, 0.9, 0.9], [0.95, 0.1]], cost) == [3, 1]
    # One row: dflash.draft_length's choice.
    from dflash_trt.dflash.draft_length import StepCosts, choose_draft_length

    costs = StepCosts(tuple(0.06 + 0.006 * n for n in range(8)), 0.0)
    confidence = [0.9, 0.8, 0.5, 0.3, 0.2, 0.1, 0.05]
    assert choose_counts([confidence], lambda n, w: costs.verify_s[0] + 0.006 * (w - 1)) \
        == [choose_draft_length(confidence, costs)]


def test_a_packed_chooser_verifies_lookups_a_padded_one_must_drop():
    """8 rows, this machine's measured 8-row costs (ms): width 1 37.1, width 5 62.9. One row with
    4 lookup drafts passing with chance 0.8: padded, all 8 rows pay width 5 (8 + 2.4 tokens in
    62.9 ms against 8 in 37.1) and the chooser verifies none; packed, 12 tokens cost a mean width
    of 1.5 (about 40.8 ms) and it verifies all 4."""
    table = [37.1, 44.6, 55.1, 56.5, 62.9]

    def verify_s(rows, width):
        lo = int(width)
        return table[lo - 1] + (table[min(lo, 4)] - table[lo - 1]) * (width - lo)

    chances = [[0.8] * 4] + [[]] * 7
    assert draft_chooser(verify_s, verify_s, packed=False)(chances, False) == [0] * 8
    assert draft_chooser(verify_s, verify_s, packed=True)(chances, False) == [4] + [0] * 7


def test_a_step_that_would_not_pay_runs_no_drafter_and_keeps_the_context(setup):
    """With `pays` saying no, every step is plain; when it says yes again the drafter gets every
    position's features (its context never skips a step), and the output stays exact."""
    target, drafter, prompts, _, _ = setup
    plain = HFTarget(target.model)
    refs = [gen.generate(plain, None, p, max_new_tokens=30, block_size=1)[0] for p in prompts[:3]]
    calls = []

    def pays(rates, rows, drafting):
        calls.append((rows, drafting))
        return len(calls) > 10  # plain for 10 steps (fewer than PROBE_EVERY), then drafting

    decoder = BatchDecoder(target, drafter, block_size=4, max_rows=3, max_seq_len=128,
                           backoff=False, pays=pays)
    rows = [decoder.add(Request(p, 30)) for p in prompts[:3]]
    steps = decoder.prefill()
    while any(row.finish is None for row in decoder.rows):
        steps += decoder.decode()
    assert [[t for row, s in steps if row is mine for t in s.token_ids] for mine in rows] == refs
    drafted = [s.num_draft_tokens for _, s in steps[3:]]
    assert drafted[:30] == [0] * 30 and sum(drafted[30:]) > 0
    assert calls[0] == (3, 3) and sum(decoder.tally["dflash"].tested) > 0


def test_a_drafter_that_never_pays_is_still_probed(setup):
    """After PROBE_EVERY declined steps the drafter drafts anyway, so the measured acceptance can
    recover when the traffic changes; a probe that still does not pay doubles the wait. A probe
    lasts until one of its steps counts: the first catches up on the skipped steps' context, and
    the drafting way's first step sets up kernels (Gate)."""
    from dflash_trt.dflash.policy import PROBE_EVERY

    target, drafter, prompts, _, _ = setup
    decoder = BatchDecoder(target, drafter, block_size=4, max_rows=1, max_seq_len=128,
                           backoff=False, pays=lambda rates, rows, drafting: False)
    decoder.add(Request(prompts[0], 4 * PROBE_EVERY))  # >= 3 * PROBE_EVERY + 5 steps
    steps = decoder.prefill()
    while decoder.rows[0].finish is None:
        steps += decoder.decode()
    drafted = [i for i, (_, s) in enumerate(steps[1:]) if s.num_draft_tokens]
    first = [PROBE_EVERY, PROBE_EVERY + 1, PROBE_EVERY + 2]  # catch-up, set-up, counted
    assert drafted == [*first, 3 * PROBE_EVERY + 3, 3 * PROBE_EVERY + 4]  # catch-up, counted


def test_lookup_drafts_reach_the_chooser_with_their_measured_acceptance(setup, monkeypatch):
    """Lookup drafts cost nothing to propose but widen the verify: the chooser gets lookup's own
    measured acceptance per position (prior 1/2), and the output stays plain greedy. Lookup here
    drafts the reference's next token, then a wrong one, so position 1 passes and 2 never does."""
    from dflash_trt.dflash import batch

    target, drafter, prompts, _, _ = setup
    prompt = prompts[1]
    ref = gen.generate(HFTarget(target.model), None, prompt, max_new_tokens=40, block_size=1)[0]

    def lookup(history, k):
        done = len(history) - len(prompt)
        right = ref[done:done + 1]
        return [*right, (right[0] + 1) % VOCAB] if right and k >= 2 else []

    monkeypatch.setattr(batch, "lookup_drafts", lookup)
    seen = []

    def choose(chances, drafted):
        seen.append((chances[0], drafted))
        return [len(chances[0])]

    decoder = BatchDecoder(target, drafter, block_size=4, max_rows=1, max_seq_len=128,
                           backoff=False, prompt_lookup=True, choose=choose)
    row = decoder.add(Request(prompt, 40))
    steps = decoder.prefill()
    while row.finish is None:
        steps += decoder.decode()
    assert [t for _, s in steps for t in s.token_ids] == ref
    # the chooser is told whether the drafter ran: on the drafter's steps, not on lookup's
    assert [d for _, d in seen] == [s.draft_source == "dflash" for _, s in steps[1:]]
    lookup_steps = [c for (c, _), (_, s) in zip(seen, steps[1:], strict=True)
                    if s.draft_source == "lookup"]
    assert len(lookup_steps) > 10 and lookup_steps[0] == [0.5, 0.5]
    first, second = lookup_steps[-1]
    assert first > 0.9 and second < 0.15  # measured: draft 1 always passed, draft 2 never


def test_the_decoder_times_its_verify_forwards_and_drafter_passes(setup):
    target, drafter, prompts, _, _ = setup
    timed = []
    decoder = BatchDecoder(target, drafter, block_size=4, max_rows=3, max_seq_len=128,
                           backoff=False, timing=lambda *t: timed.append(t))
    for p in prompts[:3]:
        decoder.add(Request(p, 6))
    decoder.prefill()
    decoder.decode()
    assert [(part, rows, width) for part, rows, width, _ in timed] == [("draft", 3, 0),
                                                                        ("verify", 3, 4)]
    assert all(seconds > 0 for *_, seconds in timed)
    # Rows verifying 1, 2 and 0 drafts: one packed forward of 6 tokens, a mean width of 2;
    # padded, the forward is 3 rows of 3 tokens.
    decoder.choose = lambda chances, drafted: [1, 2, 0]
    decoder.decode()
    assert timed[-1][:3] == ("verify", 3, 2.0)
    decoder.packed = False
    decoder.decode()
    assert timed[-1][:3] == ("verify", 3, 3)


def test_measured_steps_overrule_a_cost_model_that_says_drafting_pays(setup):
    """When the steps that ran the drafter measured fewer tokens per second than those that did
    not, at this many rows, the drafter rests (probes aside) although `pays` says yes; measured
    the other way round, it drafts. The output is plain greedy either way."""
    from dflash_trt.dflash.policy import PROBE_EVERY

    target, drafter, prompts, _, _ = setup
    ref = gen.generate(HFTarget(target.model), None, prompts[2], max_new_tokens=30,
                       block_size=1)[0]
    for drafter_rate, expect_drafting in [(1.0, False), (1e9, True)]:
        decoder = BatchDecoder(target, drafter, block_size=4, max_rows=1, max_seq_len=128,
                               backoff=False, pays=lambda rates, rows, drafting: True)
        gate = decoder.drafter_gate
        for _ in range(1 + gate.PLAIN_SAMPLES):  # the first of each is not counted
            gate.record(1, True, drafter_rate, 1.0)
            gate.record(1, False, 1e6, 1.0)
        gate.record = lambda *args, **kwargs: None  # keep the injected measurements
        decoder.add(Request(prompts[2], 30))
        steps = decoder.prefill()
        while decoder.rows[0].finish is None:
            steps += decoder.decode()
        assert [t for _, s in steps for t in s.token_ids] == ref
        drafted = [i for i, (_, s) in enumerate(steps[1:]) if s.num_draft_tokens]
        if expect_drafting:  # every step but the last, where no token is left to draft
            assert drafted == list(range(len(steps) - 2))
        else:  # a probe whose steps never count runs its longest
            assert drafted == [PROBE_EVERY + i for i in range(gate.PROBE_STEPS)]


def test_the_gate_probes_the_way_it_does_not_take_and_trusts_measurements():
    from dflash_trt.dflash.policy import PROBE_EVERY, Gate

    gate = Gate()  # predicted never to pay: bold only at probes, each wait twice the last
    taken = [i for i in range(4 * PROBE_EVERY) if gate.bold(2, False)]
    probe = range(Gate.PROBE_STEPS)  # nothing recorded: each probe runs its longest
    assert taken == [PROBE_EVERY + i for i in probe] + [3 * PROBE_EVERY + 3 + i for i in probe]
    gate = Gate()  # predicted to pay, plain way unmeasured: a plain step after PLAIN_EVERY bold
    plain = [i for i in range(3 * PROBE_EVERY) if not gate.bold(2, True)]
    every = Gate.PLAIN_EVERY + 1
    assert plain == list(range(Gate.PLAIN_EVERY, 3 * PROBE_EVERY, every))
    gate.record(2, False, 1, 1.0)  # the first step of a way sets up kernels:
    assert gate.rate(2, False) is None  # not counted
    for _ in range(Gate.PLAIN_SAMPLES - 1):
        gate.record(2, False, 10, 1.0)
    assert not all(gate.bold(2, True) for _ in range(every))  # one sample short: still measured
    gate.record(2, False, 10, 1.0)
    assert all(gate.bold(2, True) for _ in range(3 * PROBE_EVERY))  # measured now: no more
    gate.record(2, True, 1, 10.0)
    gate.record(2, True, 5, 1.0)  # the bold way measured slower: plain although predicted to pay
    assert not gate.bold(2, True) and gate.loses(4)  # and at more rows, not at fewer
    assert not gate.loses(1)
    gate.record(2, True, 25, 1.0)
    gate.record(2, True, 30, 1.0, counts=False)  # a step the caller says is not representative
    assert gate.rate(2, True) == pytest.approx(15.0) and gate.bold(2, True)  # (5 + 25) / 2 s
    gate.record(2, True, 2, 8.0)  # one stalled step among fast ones does not flip the choice
    gate.record(2, True, 1, 1.0)
    assert gate.rate(2, True) == pytest.approx(31 / 3) and gate.bold(2, True)  # 8 s one left out


def test_the_gate_judges_a_way_by_its_throughput_not_its_typical_step():
    """A weak drafter: five of eight steps accept nothing (1 token in 30 ms, slower than plain
    decoding's 1 in 20 ms), three accept five drafts (6 tokens). The median step loses; the
    throughput (23 tokens in 0.24 s, 96 tokens/s against 50) wins, and the gate drafts."""
    from dflash_trt.dflash.policy import Gate

    gate = Gate()
    for _ in range(4):
        gate.record(1, False, 1, 0.020)
    for tokens in (1, 1, 6, 1, 1, 6, 1, 6, 1):  # the first is not counted
        gate.record(1, True, tokens, 0.030)
    assert gate.rate(1, True) == pytest.approx(22 / 0.21)  # one 30 ms step left out
    assert gate.rate(1, False) == pytest.approx(50.0)
    assert not gate.loses(1) and gate.bold(1, True)


def test_a_probe_takes_the_bold_way_until_one_of_its_steps_counts():
    from dflash_trt.dflash.policy import PROBE_EVERY, Gate

    gate = Gate()
    for _ in range(2):  # both ways measured (the first of each way does not count), bold slower
        gate.record(1, True, 1, 1.0)
        gate.record(1, False, 10, 1.0)
    taken = [gate.bold(1, True) for _ in range(PROBE_EVERY + 1)]
    assert taken == [False] * PROBE_EVERY + [True]
    gate.record(1, True, 1, 1.0, counts=False)  # the probe's first step caught up on context
    assert gate.bold(1, True)  # so the probe goes on
    gate.record(1, True, 2, 1.0)  # counted: the probe ends
    assert not gate.bold(1, True)
    gate = Gate()
    for _ in range(2):
        gate.record(1, True, 1, 1.0)
        gate.record(1, False, 10, 1.0)
    taken = [gate.bold(1, True) for _ in range(PROBE_EVERY + Gate.PROBE_STEPS + 1)]
    assert taken == [False] * PROBE_EVERY + [True] * Gate.PROBE_STEPS + [False]  # at most


def test_a_step_with_prompt_chunks_takes_only_what_the_gate_measured_winning():
    """Gate.wins: the bold way only where it measured faster, at this many rows or at the fewest
    measured rows above; unmeasured, plain."""
    from dflash_trt.dflash.policy import Gate

    gate = Gate()
    assert not gate.wins(3)  # nothing measured
    for _ in range(2):  # the first of each way does not count
        gate.record(4, True, 12, 1.0)
        gate.record(4, False, 8, 1.0)
        gate.record(8, True, 9, 1.0)
        gate.record(8, False, 10, 1.0)
    assert gate.wins(4) and gate.wins(3)  # 3 rows: unmeasured, so as measured at 4
    assert not gate.wins(8) and not gate.wins(7)
    gate.record(2, True, 1, 1.0)
    gate.record(2, False, 10, 1.0)
    assert not gate.wins(4)  # it lost at fewer rows


def test_what_a_row_count_measured_itself_outweighs_a_loss_at_fewer_rows():
    """A loss at 3 rows (a count passed through while requests join) vetoes 4 rows only until
    both ways have Gate.MEASURED counted steps at 4 rows: then 4 rows' own rates decide."""
    from dflash_trt.dflash.policy import Gate

    gate = Gate()
    for _ in range(2):  # the first of each way does not count
        gate.record(3, True, 1, 1.0)
        gate.record(3, False, 10, 1.0)
    for _ in range(Gate.MEASURED - 1):
        gate.record(4, True, 20, 1.0)
        gate.record(4, False, 10, 1.0)
    assert gate.loses(4) and not gate.bold(4, True)  # not measured enough at 4: 3 decides
    gate.record(4, True, 20, 1.0)
    gate.record(4, False, 10, 1.0)
    assert not gate.loses(4) and gate.wins(4)
    assert gate.loses(5)  # 5 rows, unmeasured: the loss at 3 still stands
    for _ in range(Gate.MEASURED + 2):
        gate.record(4, True, 1, 1.0)  # the bold way now slower at 4 rows too
    assert gate.loses(4)


@pytest.mark.parametrize("predicted", [False, True])
def test_a_step_that_takes_a_prompt_chunk_drafts_only_where_the_cost_model_predicts_it_pays(
        setup, predicted):
    """The drafter gate measured drafting faster at one row, so Gate.wins says yes; the step
    that carries a joining prompt's chunk runs the drafter only if the cost model (pays) also
    predicts it pays. Both rows still decode to their plain greedy output."""
    target, drafter, prompts, _, _ = setup
    plain = HFTarget(target.model)
    refs = [gen.generate(plain, None, p, max_new_tokens=12, block_size=1)[0] for p in prompts[:2]]
    decoder = BatchDecoder(target, drafter, block_size=4, max_rows=2, max_seq_len=128,
                           backoff=False, prompt_lookup=False,
                           pays=lambda rates, rows, drafting: predicted,
                           choose=lambda chances, drafted: [len(c) for c in chances])
    assert decoder.fused  # a joining prompt's chunk rides in the decoding rows' forward
    gate = decoder.drafter_gate
    for _ in range(gate.MEASURED + 1):  # the first of each way does not count
        gate.record(1, True, 3, 1.0)
        gate.record(1, False, 1, 1.0)
    assert gate.wins(1)
    passes = []
    draft_all = decoder._draft_all
    decoder._draft_all = lambda wanted, plans: (passes.append(len(wanted)),
                                                 draft_all(wanted, plans))[1]
    first = decoder.add(Request(prompts[0], 12))
    steps = decoder.step() + decoder.step()  # its prompt, then a decoding step
    second = decoder.add(Request(prompts[1], 12))
    passes.clear()
    steps += decoder.step()  # first decodes; second's whole prompt rides in the same forward
    assert second.token is not None
    assert passes == ([1] if predicted else [])
    while any(row.finish is None for row in decoder.rows):
        steps += decoder.step()
    assert [[t for row, s in steps if row is mine for t in s.token_ids]
            for mine in (first, second)] == refs


def test_a_step_that_takes_a_prompt_chunk_neither_explores_nor_counts(setup):
    """A decoding row beside a joining one: the step that carries the new prompt's chunk asks the
    gates Gate.wins only (no Gate.bold: no probe, no plain-way sampling) and records nothing, and
    both rows still decode to their plain greedy output."""
    target, drafter, prompts, _, _ = setup
    plain = HFTarget(target.model)
    refs = [gen.generate(plain, None, p, max_new_tokens=12, block_size=1)[0] for p in prompts[:2]]
    decoder = BatchDecoder(target, drafter, block_size=4, max_rows=2, max_seq_len=128,
                           backoff=False, pays=lambda rates, rows, drafting: True,
                           choose=lambda chances, drafted: [len(c) for c in chances])
    calls = []
    for gate in (decoder.drafter_gate, decoder.width_gate):
        for name in ("bold", "wins"):
            method = getattr(gate, name)
            setattr(gate, name, lambda *a, m=method, n=name, **k: (calls.append(n), m(*a, **k))[1])
    first = decoder.add(Request(prompts[0], 12))
    steps = decoder.step() + decoder.step() + decoder.step()  # its prompt, then two decode steps
    second = decoder.add(Request(prompts[1], 12))
    calls.clear()
    counted = [{k: len(v) for k, v in g.samples.items()}
               for g in (decoder.drafter_gate, decoder.width_gate)]
    steps += decoder.step()  # first decodes; second's whole prompt rides in the same forward
    assert "bold" not in calls and "wins" in calls
    assert counted == [{k: len(v) for k, v in g.samples.items()}
                       for g in (decoder.drafter_gate, decoder.width_gate)]
    assert second.token is not None and decoder.kv.lengths[1] == len(prompts[1])
    while any(row.finish is None for row in decoder.rows):
        steps += decoder.step()
    assert [[t for row, s in steps if row is mine for t in s.token_ids]
            for mine in (first, second)] == refs
