"""The engine protocol: what the Triton model, the CLI and the benchmarks call.

An engine turns a prompt into a stream of steps. Each step carries the tokens that one target
forward pass accepted, so a speculative engine yields several tokens per step and a plain one yields
one. Engines are built from a directory (a resolved checkpoint pair or a compiled `engine/` dir).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (names follow TensorRT-LLM's SamplingParams)."""

    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None
    stop_words: tuple[str, ...] = ()
    # Draft tokens per step: None = the engine's default (block_size - 1); 0 = no speculation.
    num_draft_tokens: int | None = None
    end_id: int | None = None  # one more token that ends the output (as the model's own EOS)
    # token sequences the output never contains (TensorRT-LLM's bad_words / bad_token_ids)
    bad_words: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class StepOutput:
    """What one engine step produced."""

    token_ids: tuple[int, ...]  # new tokens of this step only
    text: str  # new text of this step only (may be empty while a UTF-8 sequence is incomplete)
    num_draft_tokens: int  # tokens the drafter proposed this step
    num_accepted_draft_tokens: int  # of those, accepted by the target
    finished: bool = False
    finish_reason: str | None = None  # "length" | "stop" | "eos" | "cancelled"
    draft_source: str | None = None  # "dflash" | "lookup" (prompt lookup); None: nothing drafted
    # dflash steps of the torch engine: the drafter's confidence in each verified draft (the peak
    # of its distribution there); empty where unknown
    draft_confidence: tuple[float, ...] = ()
    # False when the runtime reported no draft counters for this step (TensorRT-LLM versions
    # whose PyTorch flow leaves them zeroed): the counts above are then unknown, not 0
    draft_counts_known: bool = True
    # the first step: prompt tokens whose keys and values came from an earlier request's (prefix
    # reuse: the torch engine's dflash.prefix), not computed
    cached_tokens: int = 0


@dataclass
class GenerationResult:
    """A whole response, gathered from its steps."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    total_draft_tokens: int = 0
    total_accepted_draft_tokens: int = 0
    # Tokens per decoding forward. The first step (the prefill's token) is left out, as in the
    # DFlash reference, so 1.0 means "no speculation" and block_size is the ceiling.
    acceptance_lengths: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per decoding forward (1.0 without speculation)."""
        n = len(self.acceptance_lengths)
        return sum(self.acceptance_lengths) / n if n else 0.0


@runtime_checkable
class Engine(Protocol):
    """Prompt in, streamed steps out. Implementations must be safe for concurrent callers."""

    max_seq_len: int
    block_size: int

    def tokenize(self, prompt: str, chat: bool = False,
                 parse_special_tokens: bool = False) -> list[int]: ...

    def stream(
        self, prompt_ids: Sequence[int], params: SamplingParams
    ) -> Iterator[StepOutput]: ...


def collect(steps: Iterator[StepOutput]) -> GenerationResult:
    """Drain a step stream into one GenerationResult."""
    result = GenerationResult(text="")
    for i, step in enumerate(steps):
        result.text += step.text
        result.token_ids.extend(step.token_ids)
        result.total_draft_tokens += step.num_draft_tokens
        result.total_accepted_draft_tokens += step.num_accepted_draft_tokens
        if i > 0 and step.token_ids:
            result.acceptance_lengths.append(len(step.token_ids))
        if step.finished:
            result.finish_reason = step.finish_reason
    return result


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where two token lists differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# A divergence counts as a tie when the two tokens' logits are within TIE_ULPS units in the last
# place of the dtype at their magnitude (bf16 keeps 8 significant bits, fp16 11). float32 and
# float64 have no ties: there any divergence is a mismatch.
TIE_ULPS = 4
_SIGNIFICANT_BITS = {"bfloat16": 8, "float16": 11}


def tie_bound(dtype: str, value: float) -> float | None:
    """The largest logit gap near `value` that counts as a tie in `dtype` (None: no ties)."""
    bits = _SIGNIFICANT_BITS.get(dtype)
    if bits is None:
        return None
    return TIE_ULPS * 2.0 ** (math.floor(math.log2(max(abs(value), 2.0 ** -60))) - bits + 1)


def classify_outputs(spec: list[int], plain: list[int], dtype: str, logits_at=None) -> dict:
    """identical, near-tie or mismatch: at the first differing token, `logits_at(i)` (the
    target's logits for new token i after the common prefix) decides whether both tokens tie."""
    i = first_mismatch(spec, plain)
    if i is None:
        return {"status": "identical", "first_difference": None}
    row = {"status": "mismatch", "first_difference": i}
    if i < min(len(spec), len(plain)) and logits_at is not None and dtype in _SIGNIFICANT_BITS:
        logits = logits_at(i)
        a, b = float(logits[spec[i]]), float(logits[plain[i]])
        bound = tie_bound(dtype, max(abs(a), abs(b)))
        row.update(logit_gap=abs(a - b), tie_bound=bound,
                   status="near-tie" if abs(a - b) <= bound else "mismatch")
    return row
