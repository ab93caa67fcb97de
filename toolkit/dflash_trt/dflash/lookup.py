"""Prompt lookup: draft by copying what followed an earlier occurrence of the newest n-gram.

Answers often repeat their prompt (a function's signature and docstring, names, quoted text).
Where the last few tokens occurred before, the tokens that followed them then are a cheap and
often right draft. generate() uses it before the DFlash drafter when `prompt_lookup` is on:
a match drafts, otherwise the drafter does. Verification is unchanged, so output is unchanged.

Sizes chosen by replaying greedy decoding on the held-out answers of the SmolLM2 drafter (32 code
prompts; docs/benchmarks.md, "Prompt lookup"): n-grams of 4 down to 2 tokens, first occurrence.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_NGRAM = 4
MIN_NGRAM = 2


def lookup_drafts(history: Sequence[int], k: int, max_ngram: int = MAX_NGRAM,
                  min_ngram: int = MIN_NGRAM) -> list[int]:
    """Up to k tokens that followed the first earlier occurrence of history's last n tokens,
    trying n = max_ngram down to min_ngram; [] when none occurred before (or k <= 0)."""
    history = history if isinstance(history, list) else list(history)
    size = len(history)
    if k <= 0:
        return []
    for n in range(min(max_ngram, size - 1), min_ngram - 1, -1):
        tail = history[size - n:]
        first = tail[0]
        for i in range(size - n):  # occurrences that end before the tail itself
            if history[i] == first and history[i:i + n] == tail:
                return history[i + n:i + n + k]
    return []
