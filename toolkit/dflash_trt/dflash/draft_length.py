"""Adaptive draft length: how many of a block's drafts to verify, chosen per step.

A verify forward over k+1 tokens costs more the larger k is, and draft i is only worth something
when drafts 1..i are all accepted. From the drafter's own confidence in each draft (its
probability for the token it proposed) and the measured step costs, the chooser picks the k that
maximises expected tokens per second of this step:

    E[tokens | k] = 1 + sum_{j=1..k} prod_{i<=j} a(c_i)        (the target's own token, plus the
    rate(k)      = E[tokens | k] / (draft_s + verify_s[k])      accepted prefix of the drafts)

with a(c) the probability that a draft of confidence c is accepted (the confidence itself unless
a calibration is given). Fewer drafts never change the output: verification is the same, and a
truncated proposal is still a proposal, so sampling stays exact.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one step's parts on the serving device.

    verify_s[n - 1] is one target forward over n new tokens (n = 1 .. block_size, logits of the
    first row included); draft_s is one drafter block pass with the drafts' LM-head rows.
    """

    verify_s: tuple[float, ...]
    draft_s: float

    def __post_init__(self) -> None:
        if not self.verify_s or min(self.verify_s) <= 0 or self.draft_s < 0:
            raise ValueError(f"step costs must be positive: {self}")


def choose_draft_length(confidences: Sequence[float], costs: StepCosts,
                        acceptance: Callable[[float], float] | None = None) -> int:
    """The number of leading drafts to verify (0 .. len(confidences)) that maximises the step's
    expected tokens per second; ties go to the shorter verify."""
    best_k, best_rate = 0, 1.0 / (costs.draft_s + costs.verify_s[0])
    expected, survive = 1.0, 1.0
    for k, confidence in enumerate(confidences[:len(costs.verify_s) - 1], start=1):
        survive *= acceptance(confidence) if acceptance is not None else confidence
        expected += survive
        rate = expected / (costs.draft_s + costs.verify_s[k])
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k
