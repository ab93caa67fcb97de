"""Turning logits into tokens: temperature, top-k, top-p, and greedy when temperature is 0."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sampler:
    """Sampling settings plus the random generator that makes a seeded request reproducible."""

    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    generator: torch.Generator | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution to sample from: (..., V) logits -> (..., V) float32 probabilities."""
        logits = logits.float() / self.temperature
        if 0 < self.top_k < logits.shape[-1]:
            kth = torch.topk(logits, self.top_k, dim=-1).values[..., -1:]  # (..., 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
            cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            # Drop a token when the tokens before it already cover top_p (the first always stays).
            drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= self.top_p
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            logits = logits.masked_fill(drop, float("-inf"))
        return torch.softmax(logits, dim=-1)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row from (N, V) probabilities -> (N,)."""
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    def uniform(self) -> float:
        return torch.rand((), generator=self.generator).item()

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """(N, V) logits -> (N,) tokens: argmax when greedy, else a draw from `probs`."""
        if self.greedy:
            return logits.argmax(dim=-1)
        return self.draw(self.probs(logits))


def banned_next(history, bad_words) -> list[int]:
    """Tokens that would complete a banned sequence after `history` (TensorRT-LLM's bad_words):
    a one-token word always, a longer one where history ends with all but its last token."""
    banned = []
    for word in bad_words:
        head = len(word) - 1
        if head == 0 or (len(history) >= head and list(history[-head:]) == list(word[:-1])):
            banned.append(word[-1])
    return banned


def without(logits: torch.Tensor, banned: list[int]) -> torch.Tensor:
    """(V,) or (1, V) logits with the banned tokens impossible (-inf); the input is untouched."""
    if not banned:
        return logits
    out = logits.clone()
    out[..., banned] = float("-inf")
    return out
