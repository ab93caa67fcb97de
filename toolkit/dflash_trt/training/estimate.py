"""Offline acceptance estimate: replay greedy speculative decoding on text the target generated.

For a held-out sequence `prompt + the target's greedy continuation` (with its FeatureStore
features and labels), the target's side of decoding is already known: its greedy tokens are the
stored labels and its features at accepted positions are the stored features. So one batched
drafter pass drafts a block at every position, and the acceptance chain of `generate` at
temperature 0 (prefill token (not counted), then draft / accept the longest matching prefix / bonus token,
with the same max_new_tokens and stop-token rules) is replayed without running the target.
On such text it reproduces `generate`'s acceptance lengths up to floating-point ties.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_trt.training.train import draft_hidden


@dataclass
class AcceptanceEstimate:
    """Acceptance over held-out sequences, in generate's terms (tokens per target forward)."""

    mean_acceptance_length: float  # pooled over all decoding forwards (prefill not counted)
    mean_per_sequence: float  # mean of each sequence's mean
    num_steps: int
    num_sequences: int
    histogram: list[int] = field(default_factory=list)  # index i: steps that produced i+1 tokens


def greedy_length(tokens: np.ndarray, labels: np.ndarray, start: int) -> int:
    """How many greedy tokens after the prompt are known: the stored continuation as long as it
    equals the target's argmax, plus the argmax after it."""
    n = 0
    while start + n < len(tokens) and labels[start + n - 1] == tokens[start + n]:
        n += 1
    return n + 1


def replay(drafts_at, greedy: Sequence[int], block_size: int, max_new_tokens: int,
           stops: set[int]) -> list[int]:
    """Acceptance lengths of generate() at temperature 0, given drafts_at(m, k) -> k drafts
    proposed after the m-th generated token and the target's greedy tokens `greedy`."""
    limit = min(max_new_tokens, len(greedy))
    lengths: list[int] = []  # as generate (and the reference): the prefill's token is not counted
    if greedy[0] in stops or limit <= 1:
        return lengths
    generated, m = 1, 0  # m: index in `greedy` of the newest token (the block's first)
    while generated < limit:
        k = min(block_size - 1, limit - generated - 1)
        drafts = drafts_at(m, k) if k > 0 else []
        n = 0
        while n < k and drafts[n] == greedy[m + 1 + n]:
            n += 1
        new = list(greedy[m + 1:m + n + 2])  # accepted drafts and the target's bonus token
        hit = next((i for i, t in enumerate(new) if t in stops), None)
        if hit is not None:
            lengths.append(hit + 1)
            break
        lengths.append(len(new))
        generated += len(new)
        m += n + 1
    return lengths


@torch.no_grad()
def replay_inputs(drafter, embed: torch.Tensor, lm_head: torch.Tensor, store, i: int,
                  max_new_tokens: int):
    """For the store's sequence i: its prompt ids, the target's greedy tokens after the prompt,
    and drafts_at(m, k) -> the k tokens the drafter proposes after the m-th greedy token (one
    batched drafter pass; drafting only the drafter's vocabulary, if it has one, as generate)."""
    vocab = getattr(drafter, "draft_vocab", None)
    head = lm_head if vocab is None else lm_head[vocab]  # (V or K, H)
    tokens, labels, _, start = store.sequence(i)
    tokens, labels = np.asarray(tokens), np.asarray(labels)
    known = min(greedy_length(tokens, labels, start), max_new_tokens)
    greedy = [int(t) for t in labels[start - 1:start - 1 + known]]
    batch = store.batch([i]).to(embed.device)
    anchors = torch.arange(start, start + known - 1, device=embed.device)[None]  # (1, G-1)
    anchors = anchors.clamp(max=int(batch.lengths[0]) - 1)
    hidden = draft_hidden(drafter, embed, batch.features, batch.tokens, anchors,
                          drafter.block_size) if known > 1 else None  # (1, G-1, Bs, H)

    def drafts_at(m: int, k: int) -> list[int]:
        picks = (hidden[0, m, 1:k + 1] @ head.T).argmax(-1)  # (k,)
        return (picks if vocab is None else vocab[picks]).tolist()

    return tokens[:start].tolist(), greedy, drafts_at


@torch.no_grad()
def estimate_acceptance(drafter, embed: torch.Tensor, lm_head: torch.Tensor, store, *,
                        max_new_tokens: int = 128, stop_token_ids: Sequence[int] = (),
                        max_sequences: int | None = None) -> AcceptanceEstimate:
    """Replay greedy DFlash decoding on the store's sequences (train_start = prompt length)."""
    block_size = drafter.block_size
    was_training = drafter.training
    drafter.eval()
    stops = set(stop_token_ids)
    all_lengths, per_seq = [], []
    count = len(store) if max_sequences is None else min(max_sequences, len(store))
    for i in range(count):
        _, greedy, drafts_at = replay_inputs(drafter, embed, lm_head, store, i, max_new_tokens)
        lengths = replay(drafts_at, greedy, block_size, max_new_tokens, stops)
        all_lengths.extend(lengths)
        if lengths:
            per_seq.append(sum(lengths) / len(lengths))
    drafter.train(was_training)
    hist = np.bincount(np.asarray(all_lengths, dtype=np.int64), minlength=block_size + 1)[1:]
    return AcceptanceEstimate(
        mean_acceptance_length=sum(all_lengths) / max(len(all_lengths), 1),
        mean_per_sequence=float(np.mean(per_seq)) if per_seq else 0.0,
        num_steps=len(all_lengths), num_sequences=count, histogram=hist.tolist())
