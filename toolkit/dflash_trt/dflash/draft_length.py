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


def expected_tokens(position_rates: Sequence[float], k: int) -> float:
    """E[tokens | k drafts] per request from P(draft i accepted | drafts before it accepted)."""
    expected, survive = 1.0, 1.0
    for rate in position_rates[:k]:
        survive *= rate
        expected += survive
    return expected


def drafting_pays(position_rates: Sequence[float], rows: int, drafting: int,
                  verify_s: Callable[[int, float], float], draft_s: Callable[[int], float],
                  max_drafts: int, packed: bool = False) -> bool:
    """Whether running the drafter for `drafting` of a batch's `rows` rows is expected to beat a
    plain step: the best number of drafts' expected tokens per second, with the drafter pass
    paid, against rows / verify_s(rows, 1). Decided before drafting, from the acceptance per
    position. k drafts widen the verify to k + 1 tokens in every row or, `packed`
    (dflash.slots.PackedView), in the drafting rows only: a mean width of 1 + drafting * k / rows."""
    plain = rows / verify_s(rows, 1)
    for k in range(1, max_drafts + 1):
        tokens = rows + drafting * (expected_tokens(position_rates, k) - 1)
        width = 1 + drafting * k / rows if packed else k + 1
        if tokens / (draft_s(rows) + verify_s(rows, width)) > plain:
            return True
    return False


def draft_len_schedule(position_rates: Sequence[float], step_s: Callable[[int, int], float],
                       max_draft_len: int, batch_sizes: Sequence[int]) -> dict[int, int]:
    """{batch size: drafts per request} for a server that drafts the same k for every request of
    a batch: the k in 0 .. max_draft_len maximising b * E[tokens | k] / step_s(b, k), with
    step_s(b, k) the seconds of one step (drafting and verifying b * (k + 1) tokens). Made
    non-increasing in the batch size (a bigger batch never drafts more), and batch size 1 drafts
    max_draft_len (TensorRT-LLM requires schedule[1] == max_draft_len)."""
    schedule, ceiling = {}, max_draft_len
    for b in sorted(set(batch_sizes) | {1}):
        if b == 1:
            best = max_draft_len
        else:
            best = max(range(ceiling + 1),
                       key=lambda k: (b * expected_tokens(position_rates, k) / step_s(b, k), -k))
        ceiling = min(ceiling, best)
        schedule[b] = ceiling
    return schedule
