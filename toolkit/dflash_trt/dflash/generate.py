"""DFlash speculative decoding, batch size 1: draft a block in one pass, verify it in one pass.

The target is anything with `new_cache()`, `embed(ids)`, `forward(ids, cache, capture)` returning
(final hidden, layer features | None), `logits(hidden)`, and for drafters with a draft vocabulary
`logits_rows(hidden, ids)` and `vocab_size` (see dflash.target.HFTarget). The drafter is a
DFlashDraftModel (or any module with the same call, `new_cache()`, `mask_token_id`, and optionally
`draft_vocab`). Caches expose `crop(length)`.

Invariant: at temperature 0 the tokens equal the target's own greedy tokens; at temperature > 0
they are a sample from the target's (temperature/top-k/top-p processed) distribution.
With no drafter, or num_draft_tokens == 0, every step is one plain target decoding step.
With prompt_lookup, a step whose newest n-gram occurred before drafts the tokens that followed it
(dflash.lookup) instead of running the drafter; verification is the same for both.
With draft_length, each drafter step verifies only as many leading drafts as it chooses from the
drafter's confidences (dflash.draft_length); fewer drafts never change the output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from dflash_trt.dflash.lookup import lookup_drafts
from dflash_trt.dflash.sampling import Sampler, banned_next, without

# Draft back-off: after BACKOFF_PATIENCE drafter steps in a row with nothing accepted, the drafter
# rests for 1, 2, 4, ... BACKOFF_MAX steps before drafting again. A verify pass over rejected
# drafts costs more than a plain step (on CPU ~2x) and buys nothing; plain steps are exact.
# Prompt lookup is not rested and does not count: it costs nothing to try.
BACKOFF_PATIENCE = 2
BACKOFF_MAX = 32


@dataclass
class Step:
    """What one target forward produced."""

    token_ids: list[int]  # new tokens: accepted drafts plus the target's own token
    num_draft_tokens: int  # drafts verified in this step
    num_accepted_draft_tokens: int
    finish_reason: str | None = None  # "length" | "eos" when this is the last step
    draft_source: str | None = None  # "dflash" | "lookup" when this step verified drafts
    draft_confidence: tuple[float, ...] = ()  # dflash: the drafter's peak probability per draft
    cached_tokens: int = 0  # the first step: prompt tokens copied from a kept prompt (dflash.prefix)


@dataclass
class GenerationStats:
    """Counts over a whole generation."""

    acceptance_lengths: list[int] = field(default_factory=list)  # tokens per decoding forward
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_lookup_steps: int = 0  # steps whose drafts came from prompt lookup
    finish_reason: str | None = None

    @property
    def mean_acceptance_length(self) -> float:
        n = len(self.acceptance_lengths)
        return sum(self.acceptance_lengths) / n if n else 0.0


class LazyLogits:
    """Verify logits, computed on first use: a rejected first draft costs one LM-head row.
    `banned(i)`: tokens row i may not produce (bad words), masked out of what it returns.
    `first`: row 0's logits when the caller already has them (a batch computes them at once)."""

    def __init__(self, target, hidden: torch.Tensor, banned: Callable[[int], list[int]],
                 first: torch.Tensor | None = None):
        self.target, self.hidden = target, hidden[0]  # (T, H)
        self.banned = banned
        self.rows: torch.Tensor | None = None  # (T, V) once all are computed
        self.first: torch.Tensor | None = first  # (V,)

    def __getitem__(self, i: int) -> torch.Tensor:
        return without(self._row(i), self.banned(i))

    def _row(self, i: int) -> torch.Tensor:
        if i == 0 and self.rows is None:
            if self.first is None:
                self.first = self.target.logits(self.hidden[0])  # (V,)
            return self.first
        if self.rows is None:
            rest = self.target.logits(self.hidden[1:])  # (T-1, V)
            self.rows = torch.cat([self.first[None], rest]) if self.first is not None \
                else self.target.logits(self.hidden)
        return self.rows[i]


def draft_block(target, drafter, token: int, context: torch.Tensor, cache, start: int,
                block_size: int, k: int, sampler: Sampler):
    """Propose k tokens after `token` (at position `start`) in one drafter pass.

    context: (1, C, k*H) target features of positions start-C .. start-1, not yet in the cache.
    Returns the drafts, their distribution q (k, V) (None when drafting greedily) and the
    drafter's confidence at each position: the largest probability of its distribution there
    (the greedy draft's own probability), known before any draft is sampled.
    """
    # The block is always full width: a drafter trained on block_size positions sees the same shape.
    block = torch.full((1, block_size), drafter.mask_token_id, dtype=torch.long,
                       device=target.device)  # (1, B)
    block[0, 0] = token
    hidden = drafter(target.embed(block), context, cache)  # (1, B, H)
    cache.crop(start)  # keep the injected context, drop the block's own keys
    vocab = getattr(drafter, "draft_vocab", None)  # (K,) or None: the tokens it drafts
    drafted = hidden[0, 1:k + 1]  # (k, H): only the drafts we will verify
    logits = target.logits(drafted) if vocab is None else target.logits_rows(drafted, vocab)
    return pick_drafts(logits, vocab, sampler, target.vocab_size)


def pick_drafts(logits: torch.Tensor, vocab: torch.Tensor | None, sampler: Sampler,
                vocab_size: int):
    """Drafts from the drafter's logits (k, V) or (k, K) over `vocab`: the drafts, their
    distribution q (k, V) over the whole vocabulary (None when greedy) and the confidences."""
    if sampler.greedy:
        confidence, picks = logits.float().softmax(dim=-1).max(dim=-1)  # (k,), (k,)
        return (picks if vocab is None else vocab[picks]).tolist(), None, confidence.tolist()
    q = sampler.probs(logits)  # (k, V) or (k, K)
    picks = sampler.draw(q)  # (k,)
    # The peak of q, not q(d_i): a draft length chosen from the sampled drafts themselves would
    # bias which drafts get verified, and rejection sampling would no longer be exact.
    confidence = q.max(dim=-1).values.tolist()  # (k,)
    if vocab is None:
        return picks.tolist(), q, confidence
    full = q.new_zeros(q.shape[0], vocab_size)  # q over the whole vocabulary: 0 outside `vocab`
    full[:, vocab] = q
    return vocab[picks].tolist(), full, confidence


def copied_drafts(target, drafts: list[int], sampler: Sampler):
    """Prompt-lookup drafts as draft_block returns them: q is one-hot (a deterministic proposal),
    so rejection sampling accepts d with probability p(d) and stays exact."""
    if sampler.greedy or not drafts:
        return drafts, None
    q = torch.zeros(len(drafts), target.vocab_size, device=target.device)  # (k, V)
    q[torch.arange(len(drafts), device=q.device), torch.tensor(drafts, device=q.device)] = 1.0
    return drafts, q


def accept_greedy(logits: LazyLogits, drafts: list[int]) -> tuple[int, int]:
    """Longest prefix of drafts equal to the target's argmax, plus the target's next token."""
    n = 0
    while True:
        choice = int(logits[n].argmax())
        if n == len(drafts) or drafts[n] != choice:
            return n, choice
        n += 1


def accept_sampled(logits: LazyLogits, drafts: list[int], q: torch.Tensor | None,
                   sampler: Sampler) -> tuple[int, int]:
    """Speculative rejection sampling: accept d with prob min(1, p(d)/q(d)), else resample."""
    for i, d in enumerate(drafts):
        p = sampler.probs(logits[i])  # (V,)
        if sampler.uniform() * q[i, d] < p[d]:  # u < p/q without dividing by a tiny q
            continue
        residual = (p - q[i]).clamp_min(0)  # (V,): the mass q over-proposed is taken back
        if residual.sum() <= 0:  # p == q up to rounding: any draw from p is exact
            residual = p
        return i, int(sampler.draw((residual / residual.sum())[None])[0])
    return len(drafts), int(sampler.draw(sampler.probs(logits[len(drafts)])[None])[0])


@torch.inference_mode()
def generate_steps(target, drafter, prompt_ids: Sequence[int], *, max_new_tokens: int,
                   block_size: int, num_draft_tokens: int | None = None,
                   stop_token_ids: Sequence[int] = (),
                   sampler: Sampler | None = None, backoff: bool = False,
                   prompt_lookup: bool = False,
                   draft_length: Callable[[list[float]], int] | None = None,
                   bad_words: Sequence[Sequence[int]] = ()) -> Iterator[Step]:
    """Yield one Step per target forward until max_new_tokens or a stop token.

    backoff: rest a drafter that keeps missing (see BACKOFF_PATIENCE); off to measure a drafter.
    prompt_lookup: draft by n-gram lookup in prompt + output where it matches (dflash.lookup).
    draft_length: confidences of a drafter block -> how many leading drafts to verify.
    bad_words: token sequences the output never contains: the target's distribution at every
    position (plain step or verify row alike) has their last token masked where the tokens before
    it match, so drafting stays lossless against the masked target.
    """
    sampler = sampler or Sampler()
    draft_len = 0 if drafter is None or block_size <= 1 else block_size - 1
    if num_draft_tokens is not None:
        draft_len = max(0, min(draft_len, num_draft_tokens))
    stops = set(stop_token_ids)
    if max_new_tokens <= 0:
        return
    device = target.device
    capture = draft_len > 0  # plain decoding needs no features

    # 1. Prefill: the prompt through the target; the first new token comes from its last position.
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)  # (1, P)
    target_cache = target.new_cache()
    hidden, features = target.forward(prompt, target_cache, capture)  # (1, P, H), (1, P, k*H)
    context = [features]  # target features not yet in the drafter's cache, in position order
    token = int(sampler.sample(without(target.logits(hidden[:, -1]),
                                       banned_next(prompt_ids, bad_words)))[0])
    generated = 1
    finish = "eos" if token in stops else "length" if generated >= max_new_tokens else None
    yield Step([token], 0, 0, finish)
    draft_cache = drafter.new_cache() if capture else None
    start = len(prompt_ids)  # position of `token`: the newest token, not yet in the target cache
    history = [*prompt_ids, token]  # what prompt lookup searches
    misses, rest, resting = 0, 1, 0  # back-off: drafter steps missed, next rest, steps left

    while finish is None:
        # 2. Draft k tokens after `token`; never more than fit in max_new_tokens with the bonus:
        #    by prompt lookup where it matches, else by the drafter unless it is resting. Steps
        #    that skip the drafter leave their features in `context` for its next pass.
        k = min(draft_len, max_new_tokens - generated - 1)
        drafts, q, source, confidence = [], None, None, []
        if k > 0 and prompt_lookup:
            drafts, q = copied_drafts(target, lookup_drafts(history, k), sampler)
            source = "lookup" if drafts else None
        if k > 0 and not drafts and resting:
            resting -= 1
        elif k > 0 and not drafts:
            feats = context[0] if len(context) == 1 else torch.cat(context, dim=1)
            drafts, q, confidence = draft_block(target, drafter, token, feats, draft_cache,
                                                start, block_size, k, sampler)
            context, source = [], "dflash"  # the context is now in the drafter's cache
            if draft_length is not None:  # verify only the drafts worth their cost
                keep = draft_length(confidence)
                drafts, q = drafts[:keep], None if q is None else q[:keep]

        # 3. Verify [token, d1..dk] at positions start..start+k in one target pass.
        verify_ids = torch.tensor([[token, *drafts]], dtype=torch.long, device=device)  # (1, k+1)
        hidden, features = target.forward(verify_ids, target_cache, capture)  # (1, k+1, H)

        # 4. Accept a prefix of the drafts plus one token from the target.
        logits = LazyLogits(target, hidden, lambda i, d=drafts: banned_next(
            history + d[:i], bad_words) if bad_words else [])
        if sampler.greedy:
            n, bonus = accept_greedy(logits, drafts)
        else:
            n, bonus = accept_sampled(logits, drafts, q, sampler)
        new_tokens = [*drafts[:n], bonus]
        if backoff and source == "dflash":
            misses, rest = (misses + 1, rest) if n == 0 else (0, 1)
            if misses >= BACKOFF_PATIENCE:
                misses, resting, rest = 0, rest, min(2 * rest, BACKOFF_MAX)

        # 5. Crop caches to the accepted tokens; their features become the drafter's new context.
        target_cache.crop(start + n + 1)  # holds positions 0 .. start+n (token, d1..dn)
        if capture:
            context.append(features[:, :n + 1])  # (1, n+1, k*H)
        start += n + 1
        token = bonus

        # 6. Stop at the first stop token or at max_new_tokens.
        hit = next((i for i, t in enumerate(new_tokens) if t in stops), None)
        if hit is not None:
            new_tokens, finish = new_tokens[:hit + 1], "eos"
        generated += len(new_tokens)
        history.extend(new_tokens)
        if finish is None and generated >= max_new_tokens:
            finish = "length"
        yield Step(new_tokens, len(drafts), n, finish, source, tuple(confidence[:len(drafts)]))


def generate(target, drafter, prompt_ids: Sequence[int], **kwargs) -> tuple[list[int], GenerationStats]:
    """Run generate_steps to the end: the new token ids and their stats."""
    tokens: list[int] = []
    stats = GenerationStats()
    for i, step in enumerate(generate_steps(target, drafter, prompt_ids, **kwargs)):
        tokens.extend(step.token_ids)
        if i > 0:  # as the reference: the prefill's token is not a decoding step
            stats.acceptance_lengths.append(len(step.token_ids))
        stats.num_draft_tokens += step.num_draft_tokens
        stats.num_accepted_draft_tokens += step.num_accepted_draft_tokens
        stats.num_lookup_steps += step.draft_source == "lookup"
        stats.finish_reason = step.finish_reason
    return tokens, stats
