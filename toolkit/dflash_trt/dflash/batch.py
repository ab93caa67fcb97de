"""Batched DFlash decoding: many requests, one drafter pass and one target forward per step.

Each request is a row of the batch with its own length in the target's and the drafter's caches
(dflash.slots). A step (`step`):
1. Prompts: a new row starts after the longest prefix its prompt shares with a kept one
   (dflash.prefix: those keys and values are copied, not computed); each row still in its prompt
   takes its next chunk; the chunk's features go straight into the drafter's cache; the last
   chunk samples the first token and keeps the prompt for later ones. Where the target packs
   (HFTarget.packs), the chunks ride in step 2's forward (chunked prefill, PREFILL_CHUNK tokens in
   all per step); otherwise each row runs its chunk in a forward of its own first (`prefill`).
2. `decode`: every decoding row gets its drafts (prompt lookup, or the drafter, or none while it
   rests or asks for none); one drafter pass serves all rows (rows that do not draft just absorb
   their new context); how many drafts each row verifies is chosen for the whole batch
   (dflash.policy's `choose_counts`); one target forward verifies every row, its tokens packed
   with the other rows' (dflash.slots.PackedView: a row's drafts cost the forward their own
   tokens, not a width every row is padded to); each row accepts its own prefix
   (dflash.generate's acceptance, per-row sampler) and its caches are set to what it accepted.

Lossless per row for the same reasons as dflash.generate: a row's tokens are verified against the
target's distribution at that row's own positions. Padding (in attention, or in the whole forward
of a target that cannot pack) never reaches a real token: it sits past each row's length and the
causal mask stops at the row's own tokens. A batched forward computes
a row's logits with other matrix shapes than batch 1 does, so floats may differ in the last bits
(exact in float64; in float32 a flip needs a tie at float32 precision).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dflash_trt.dflash.generate import (
    BACKOFF_MAX,
    BACKOFF_PATIENCE,
    LazyLogits,
    Step,
    accept_greedy,
    accept_sampled,
    copied_drafts,
    pick_drafts,
)
from dflash_trt.dflash.lookup import lookup_drafts
from dflash_trt.dflash.policy import Gate, Tally
from dflash_trt.dflash.prefix import PrefixStore
from dflash_trt.dflash.sampling import Sampler, banned_next, without

# Prompt tokens per step (in all when chunks ride in the verify forward, per row otherwise): a long
# prompt does not stall the batch.
PREFILL_CHUNK = 512


@dataclass
class Request:
    """What one row generates (dflash.generate.generate_steps' arguments)."""

    prompt_ids: Sequence[int]
    max_new_tokens: int
    sampler: Sampler = field(default_factory=Sampler)
    stop_token_ids: Sequence[int] = ()
    num_draft_tokens: int | None = None
    bad_words: Sequence[Sequence[int]] = ()


class Row:
    """A request's decoding state; row i of the batch lives in slot i of both caches."""

    def __init__(self, request: Request, draft_len: int):
        self.request = request
        self.draft_len = draft_len if request.num_draft_tokens is None \
            else max(0, min(draft_len, request.num_draft_tokens))
        self.stops = set(request.stop_token_ids)
        self.prefilled = 0  # prompt tokens in the target cache
        self.cached = 0  # of those, copied from a kept prompt (dflash.prefix)
        self.token: int | None = None  # the newest token, not yet in the target cache
        self.context: list[torch.Tensor] = []  # (1, c, k*H) features not in the drafter cache
        self.history = list(request.prompt_ids)  # what prompt lookup searches
        self.generated = 0
        self.finish: str | None = None
        self.misses, self.rest, self.resting = 0, 1, 0  # back-off, as dflash.generate

    @property
    def decoding(self) -> bool:
        return self.token is not None and self.finish is None


class BatchDecoder:
    """Rows of a batch and their caches; `step` advances every row one step (`prefill`, then
    `decode`, where prompt chunks do not ride in the verify forward).

    choose: (per-row chance of each draft passing, whether the drafter ran this step) -> drafts
    each row verifies (draft_chooser), or None to verify every draft. A drafter draft's chance
    is acceptance(its confidence) (the confidence itself without a calibration); a lookup draft's
    is lookup's acceptance at its position, measured here.
    pays: (the drafter's acceptance per draft position, rows, drafting rows) -> whether the
    drafter pass is worth running this step (dflash.draft_length.drafting_pays), or None to always
    draft. The acceptance per position is measured here, on the drafts this decoder verified.
    timing: called with ("verify", rows, width, seconds) after each verify forward without prompt
    chunks (its first logits included; a packed forward's width is its mean, tokens over rows) and
    ("draft", rows, 0, seconds) after each drafter pass, so the costs the chooser uses can follow
    the machine (engines.cost_model.OnlineCosts).
    packed: verify rows with different numbers of tokens packed (dflash.slots.PackedView) rather
    than padded to the widest; by default where the target can (HFTarget.packs).
    prefix_tokens: prompt tokens whose keys and values are kept for later prompts that start the
    same way (dflash.prefix; 0: none kept).
    """

    def __init__(self, target, drafter, *, block_size: int, max_rows: int, max_seq_len: int,
                 prompt_lookup: bool = False, backoff: bool = True,
                 choose: Callable[[list[list[float]], bool], int] | None = None,
                 pays: Callable[[list[float], int, int], bool] | None = None,
                 acceptance: Callable[[float], float] | None = None,
                 timing: Callable[[str, int, float, float], None] | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, packed: bool | None = None,
                 prefix_tokens: int = 0):
        self.target, self.drafter = target, drafter
        self.block_size, self.max_rows = block_size, max_rows
        self.prompt_lookup, self.backoff, self.choose, self.pays = prompt_lookup, backoff, choose, pays
        self.acceptance, self.timing = acceptance, timing
        self.prefill_chunk = prefill_chunk
        self.packed = getattr(target, "packs", False) if packed is None else packed
        self.fuse_prompts = self.packed  # prompt chunks ride in the verify forward (step 1)
        self.draft_len = 0 if drafter is None or block_size <= 1 else block_size - 1
        capacity = max_seq_len + block_size  # room for a padded verify past a row's end
        self.kv = target.new_slot_cache(max_rows, capacity)
        self.dkv = drafter.new_slot_cache(max_rows, capacity) if self.draft_len else None
        self.rows: list[Row] = []
        self.tally = {"dflash": Tally(self.draft_len), "lookup": Tally(self.draft_len)}
        self.drafter_gate = Gate()  # run the drafter, or not
        # The gate skipped the drafter since its last pass: rows that wanted it gathered context,
        # which its next pass absorbs at once (a catch-up, not a representative step).
        self.drafter_skipped = False
        self.width_gate = Gate()  # verify lookup drafts, or not (steps without the drafter)
        self.feature_dim, self.feature_dtype = 0, None  # of the target features, seen at prefill
        # finished prompts' keys and values, for prompts that start the same way (dflash.prefix)
        self.prefixes = PrefixStore(prefix_tokens) if prefix_tokens > 0 else None

    def _caches(self) -> list:
        """The target's cache, then the drafter's where there is one."""
        return [self.kv] if self.dkv is None else [self.kv, self.dkv]

    @property
    def fused(self) -> bool:
        """Prompt chunks ride in the verify forward: only where it is packed."""
        return self.packed and self.fuse_prompts

    def position_rates(self, source: str = "dflash") -> list[float]:
        """P(draft i accepted | drafts before it accepted) for a source, measured (Tally)."""
        return self.tally[source].rates()

    @torch.inference_mode()
    def add(self, request: Request) -> Row:
        """A new row for the request; its prompt starts after the longest prefix it shares with
        a kept prompt (self.prefixes), whose keys and values are copied into its slots."""
        if len(self.rows) >= self.max_rows:
            raise RuntimeError("batch full")
        row, i = Row(request, self.draft_len), len(self.rows)
        n, saved = (0, None) if self.prefixes is None else self.prefixes.match(request.prompt_ids)
        caches = self._caches()
        for cache, layers in zip(caches, saved or [[]] * len(caches), strict=True):
            cache.put(i, layers, n)
        row.prefilled = row.cached = n
        self.rows.append(row)
        return row

    @torch.inference_mode()
    def remove(self, row: Row) -> None:
        """Free the row's slot at once: the last row moves into it. A finished row's sequence is
        kept first (self.prefixes: a conversation's next turn starts with it), as far as both
        caches hold it (the drafter's may lag by the context it has not absorbed)."""
        i, last = self.rows.index(row), len(self.rows) - 1
        if self.prefixes is not None and row.finish is not None:
            n = min(len(row.history), *(c.lengths[i] for c in self._caches()))
            self.prefixes.keep(row.history[:n], lambda n: [c.take(i, n) for c in self._caches()])
        if i != last:
            for cache in (self.kv, self.dkv):
                if cache is not None:
                    cache.move(last, i)
            self.rows[i] = self.rows[last]
        self.rows.pop()

    def step(self, each: Callable[[Row, Step], None] | None = None) -> list[tuple[Row, Step]]:
        """One step of every row: its prompt's next chunk, or a decoding step; `each(row, step)`
        is called with every output as soon as it exists. Packed, prompt chunks ride in the
        verify forward (chunked prefill: a joining request costs the batch no forward of its
        own); otherwise each row in its prompt runs a forward of its own first (`prefill`)."""
        out = [] if self.fused else self.prefill(each)
        for row_step in self.decode():
            out.append(row_step)
            if each is not None:
                each(*row_step)
        return out

    @torch.inference_mode()
    def prefill(self, each: Callable[[Row, Step], None] | None = None) -> list[tuple[Row, Step]]:
        """One prompt chunk for every row still in its prompt, each in a forward of its own; the
        first token of those done.

        `each(row, step)` is called with a row's first token as soon as it is sampled, before
        the next row's prefill (so a stream's first token does not wait for its neighbours')."""
        out = []
        for i, row in enumerate(self.rows):
            if row.token is not None or row.finish is not None:
                continue
            prompt = row.request.prompt_ids
            chunk = list(prompt[row.prefilled:row.prefilled + self.prefill_chunk])
            ids = torch.tensor([chunk], dtype=torch.long, device=self.target.device)
            hidden, features = self.target.forward(ids, self.kv.view(i, i + 1, len(chunk)),
                                                   self.dkv is not None)
            step = self._prompted(i, len(chunk), hidden[:, -1], features)
            if step is not None:
                out.append((row, step))
                if each is not None:
                    each(row, step)
        return out

    def _chunks(self) -> dict[int, list[int]]:
        """The next prompt chunk of rows still in their prompt, PREFILL_CHUNK tokens in all (in
        row order), for a packed step."""
        chunks, budget = {}, self.prefill_chunk
        for i, row in enumerate(self.rows):
            if row.token is None and row.finish is None and budget > 0:
                prompt = row.request.prompt_ids
                chunks[i] = list(prompt[row.prefilled:row.prefilled + budget])
                budget -= len(chunks[i])
        return chunks

    def _prompted(self, i: int, count: int, last: torch.Tensor,
                  features: torch.Tensor | None) -> Step | None:
        """Row i's forward took `count` more prompt tokens (their features (1, count, k*H) go
        into the drafter's cache now); when the prompt is done, its first token from `last`
        (1, H), the final hidden state of the prompt's last token."""
        row = self.rows[i]
        self.kv.lengths[i] += count
        row.prefilled += count
        if self.dkv is not None:
            self.feature_dim, self.feature_dtype = features.shape[-1], features.dtype
            self.drafter.forward_rows(None, features, [count], self.dkv.view(i, i + 1, count))
            self.dkv.lengths[i] += count
        prompt, req = row.request.prompt_ids, row.request
        if row.prefilled < len(prompt):
            return None
        if self.prefixes is not None:
            self.prefixes.keep(prompt, lambda n: [c.take(i, n) for c in self._caches()])
        logits = without(self.target.logits(last), banned_next(prompt, req.bad_words))
        row.token = int(req.sampler.sample(logits)[0])
        row.history.append(row.token)
        row.generated = 1
        row.finish = "eos" if row.token in row.stops else \
            "length" if req.max_new_tokens <= 1 else None
        return Step([row.token], 0, 0, row.finish, cached_tokens=row.cached)

    def _drafts(self, row: Row) -> tuple[list[int], object, str | None, list[float], bool]:
        """(drafts, q, source, confidence, wants the drafter) for a decoding row."""
        k = min(row.draft_len, row.request.max_new_tokens - row.generated - 1)
        if k <= 0:
            return [], None, None, [], False
        if self.prompt_lookup:
            drafts, q = copied_drafts(self.target, lookup_drafts(row.history, k), row.request.sampler)
            if drafts:
                return drafts, q, "lookup", self.position_rates("lookup")[:len(drafts)], False
        if row.resting:
            row.resting -= 1
            return [], None, None, [], False
        return [], None, "dflash", [], True

    def _draft_all(self, wanted: list[int], plans: list) -> None:
        """One drafter pass over every row (those not drafting absorb their new context)."""
        n, device = len(self.rows), self.target.device
        pending = [torch.cat(r.context, dim=1)[0] if r.context else None for r in self.rows]
        lengths = [0 if p is None else p.shape[0] for p in pending]
        context = torch.zeros(n, max(lengths), self.feature_dim, dtype=self.feature_dtype,
                              device=device)  # (n, C, k*H), right-padded
        for r, p in enumerate(pending):
            if p is not None:
                context[r, :p.shape[0]] = p
        block = torch.full((n, self.block_size), self.drafter.mask_token_id, dtype=torch.long,
                           device=device)
        block[:, 0] = torch.tensor([r.token if r.token is not None else self.drafter.mask_token_id
                                    for r in self.rows], device=device)
        hidden = self.drafter.forward_rows(self.target.embed(block), context, lengths,
                                           self.dkv.view(0, n, max(lengths)))  # (n, B, H)
        for r, row in enumerate(self.rows):
            self.dkv.lengths[r] += lengths[r]
            row.context = []
        # The drafts' LM-head rows for every drafting row in one matmul, then each row's picks.
        vocab = getattr(self.drafter, "draft_vocab", None)
        counts = [min(self.rows[r].draft_len,
                      self.rows[r].request.max_new_tokens - self.rows[r].generated - 1)
                  for r in wanted]
        drafted = torch.cat([hidden[r, 1:k + 1] for r, k in zip(wanted, counts, strict=True)])
        logits = self.target.logits(drafted) if vocab is None \
            else self.target.logits_rows(drafted, vocab)  # (sum k, V) or (sum k, K)
        for r, part in zip(wanted, logits.split(counts), strict=True):
            sampler = self.rows[r].request.sampler
            plans[r] = (*pick_drafts(part, vocab, sampler, self.target.vocab_size), "dflash")

    @torch.inference_mode()
    def decode(self) -> list[tuple[Row, Step]]:
        """One verify forward for every decoding row (packed: with the next prompt chunk of rows
        still in their prompt, whose first tokens come out when their prompt is done)."""
        began = time.perf_counter()
        rows = self.rows
        live = [r for r, row in enumerate(rows) if row.decoding]
        chunks = self._chunks() if self.fused else {}
        if not live and not chunks:
            return []
        # 1. Drafts: lookup where it matches, else the drafter (one pass for all), else none.
        plans: list = [None] * len(rows)  # (drafts, q, confidence, source) per row
        wanted = []
        for r in live:
            drafts, q, source, confidence, wants = self._drafts(rows[r])
            plans[r] = (drafts, q, confidence, source)
            if wants:
                wanted.append(r)
        # A step the drafter gate decides; one that also takes prompt chunks drafts only where
        # the cost model predicts and the gate measured (Gate.wins) that drafting pays: its
        # seconds are the prompt's, so it can test neither way.
        contested = bool(wanted) and self.pays is not None
        predicted = contested and self.pays(self.position_rates(), len(live), len(wanted))
        if contested and not ((predicted and self.drafter_gate.wins(len(live))) if chunks
                              else self.drafter_gate.bold(len(live), predicted)):
            for r in wanted:  # a plain step: at this load the drafter costs more than it brings
                plans[r] = ([], None, [], None)
            wanted, self.drafter_skipped = [], True
        catch_up = bool(wanted) and self.drafter_skipped
        if wanted:
            self.drafter_skipped = False
            drafted = time.perf_counter()
            self._draft_all(wanted, plans)
            if self.timing is not None:
                self.timing("draft", len(rows), 0, time.perf_counter() - drafted)
        # 2. How many drafts each row verifies, chosen for the whole batch.
        if self.choose is not None and live:
            counts = self.choose([self._chances(*plans[r][2:]) for r in live], bool(wanted))
            if any(counts) and not wanted and not (self.width_gate.wins(len(live)) if chunks
                                                   else self.width_gate.bold(len(live), True)):
                counts = [0] * len(live)
        else:
            counts = [len(plans[r][0]) for r in live]
        kept, tokens = {}, [chunks.get(r, []) for r in range(len(rows))]
        for r, count in zip(live, counts, strict=True):
            drafts, q, confidence, source = plans[r]
            drafts = drafts[:count]
            kept[r] = (drafts, None if q is None else q[:len(drafts)], confidence, source)
            tokens[r] = [rows[r].token, *drafts]
        # 3. One forward verifies every row: packed when rows bring different numbers of tokens
        # (prompt chunks included), else padded to one width (rows that bring none ride along,
        # ignored).
        starts = list(self.kv.lengths[:len(rows)])
        verified = time.perf_counter()
        width = max(len(t) for t in tokens)
        capture = self.dkv is not None
        if self.packed and any(len(t) != width for t in tokens):
            view = self.kv.packed(0, len(rows), [len(t) for t in tokens])
            ids = torch.tensor([[t for row_tokens in tokens for t in row_tokens]],
                               device=self.target.device)  # (1, T)
            hidden, features = self.target.forward(ids, view, capture)  # (1, T, ...)

            def part(x, r):  # row r's tokens: (1, len(tokens[r]), ...)
                return x[:, view.offsets[r]:view.offsets[r] + len(tokens[r])]
            forward_width = len(view.rows) / len(rows)
        else:
            ids = torch.zeros(len(rows), width, dtype=torch.long, device=self.target.device)
            for r, row_tokens in enumerate(tokens):
                ids[r, :len(row_tokens)] = torch.tensor(row_tokens, dtype=torch.long)
            hidden, features = self.target.forward(ids, self.kv.view(0, len(rows), width),
                                                   capture)  # (n, width, ...)

            def part(x, r):
                return x[r:r + 1, :len(tokens[r])]
            forward_width = width
        # Every row's first logits in one LM-head call; further rows only where drafts pass.
        firsts = self.target.logits(torch.cat([part(hidden, r)[:, 0] for r in kept])) \
            if kept else []
        if self.timing is not None and not chunks:
            self.timing("verify", len(rows), forward_width, time.perf_counter() - verified)
        out = [(rows[r], self._accept(r, starts[r], part(hidden, r),
                                      None if features is None else part(features, r), first,
                                      *plan))
               for (r, plan), first in zip(kept.items(), firsts, strict=True)]
        produced = sum(len(step.token_ids) for _, step in out)
        seconds = time.perf_counter() - began
        for r, chunk in chunks.items():
            step = self._prompted(r, len(chunk), part(hidden, r)[:, -1],
                                  None if features is None else part(features, r))
            if step is not None:
                out.append((rows[r], step))
        # A step that also took prompt chunks says nothing of decoding's speed: not counted.
        if contested:
            self.drafter_gate.record(len(live), bool(wanted), produced, seconds,
                                     counts=not catch_up and not chunks)
        if self.choose is not None and live and not wanted and not chunks:
            self.width_gate.record(len(live), width > 1, produced, seconds)
        return out

    def _chances(self, confidence: list[float], source: str | None) -> list[float]:
        """Each draft's chance of passing once those before it passed, for the chooser."""
        if source == "dflash" and self.acceptance is not None:
            return [self.acceptance(c) for c in confidence]
        return confidence  # the drafter's raw confidence, or lookup's measured rates

    def _accept(self, r, start, hidden, features, first, drafts, q, confidence, source) -> Step:
        """Row r's verify outcome from its own hidden states and features (1, 1 + drafts, ...)."""
        row, req = self.rows[r], self.rows[r].request
        bad = req.bad_words
        logits = LazyLogits(self.target, hidden, lambda i, d=drafts: (
            banned_next(row.history + d[:i], bad) if bad else []), first)
        if req.sampler.greedy:
            n, bonus = accept_greedy(logits, drafts)
        else:
            n, bonus = accept_sampled(logits, drafts, q, req.sampler)
        new_tokens = [*drafts[:n], bonus]
        if source is not None and drafts:
            self.tally[source].record(n, len(drafts))
        if self.backoff and source == "dflash":
            row.misses, row.rest = (row.misses + 1, row.rest) if n == 0 else (0, 1)
            if row.misses >= BACKOFF_PATIENCE:
                row.misses, row.resting, row.rest = 0, row.rest, min(2 * row.rest, BACKOFF_MAX)
        self.kv.lengths[r] = start + n + 1  # token, d1..dn
        if features is not None:
            row.context.append(features[:, :n + 1])
        row.token = bonus
        hit = next((i for i, t in enumerate(new_tokens) if t in row.stops), None)
        if hit is not None:
            new_tokens, row.finish = new_tokens[:hit + 1], "eos"
        row.generated += len(new_tokens)
        row.history.extend(new_tokens)
        if row.finish is None and row.generated >= req.max_new_tokens:
            row.finish = "length"
        return Step(new_tokens, len(drafts), n, row.finish, source,
                    tuple(confidence[:len(drafts)]) if source == "dflash" else ())

