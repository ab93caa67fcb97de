"""Prompts' keys and values kept for later prompts that start the same way (prefix reuse).

Served chat prompts share their start: SmolLM2's chat template puts the same 24-token system turn
before every user turn, a third of a short chat prompt, and a multi-turn conversation resends
all of its earlier turns. The batch (dflash.batch) keeps each prompt's keys and values, the
target's and the drafter's, here when its prefill is done, and the whole sequence when the
request finishes; a new prompt starts from the longest prefix it shares with a kept one and runs
only the rest (TensorRT-LLM's KV cache block reuse and vLLM's prefix caching
do the same on GPU; this store copies, where they share blocks).

Lossless as batching is: a reused position's keys and values are those the prompt's own prefill
would compute, from another forward's matrix shapes (exact in float64; in float32 they may differ
in the last bits, as a batched forward's do).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

# per cache (target, then drafter): per layer (keys, values), (kv_heads, tokens, head_dim) each
Saved = list


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b, strict=False):  # up to the shorter
        if x != y:
            break
        n += 1
    return n


class PrefixStore:
    """Kept prompts, up to `budget` tokens in all, the least recently used dropped first."""

    MIN_TOKENS = 8  # a shorter shared start is not worth the copy

    def __init__(self, budget: int):
        self.budget = budget
        self._kept: OrderedDict[tuple[int, ...], Saved] = OrderedDict()
        self.tokens = 0  # kept
        self.reused = 0  # prompt tokens taken from here instead of computed

    def __len__(self) -> int:
        return len(self._kept)

    def match(self, prompt: Sequence[int]) -> tuple[int, Saved | None]:
        """(n, saved): the prompt's first n tokens are saved's first n (at most all but the
        prompt's last, whose logits the prompt's forward must give); (0, None) when no kept prompt
        shares MIN_TOKENS."""
        best, key = 0, None
        for tokens in self._kept:
            n = common_prefix(tokens, prompt)
            if n > best:
                best, key = n, tokens
        n = min(best, len(prompt) - 1)
        if n < self.MIN_TOKENS:
            return 0, None
        self._kept.move_to_end(key)
        self.reused += n
        return n, self._kept[key]

    def keep(self, tokens: Sequence[int], take: Callable[[int], Saved]) -> None:
        """Keep a sequence whose keys and values `take(len(tokens))` copies out of the caches
        (not called when it is kept already, or too long for the budget); kept sequences it
        starts with go (it holds them)."""
        key = tuple(tokens)
        if key in self._kept:
            self._kept.move_to_end(key)
            return
        if not self.MIN_TOKENS <= len(key) <= self.budget:
            return
        for held in [k for k in self._kept if len(k) < len(key) and key[:len(k)] == k]:
            del self._kept[held]
            self.tokens -= len(held)
        self._kept[key] = take(len(key))
        self.tokens += len(key)
        while self.tokens > self.budget:
            dropped, _ = self._kept.popitem(last=False)
            self.tokens -= len(dropped)
