"""Serving metrics from request timelines: pure functions, no I/O, no clock.

Definitions follow GenAI-Perf / AIPerf, so numbers compare with what the field publishes:

- A request's timeline is its send time, the arrival time of each streamed response and the number
  of output tokens each response carried (a speculative step streams several tokens at once).
- TTFT (time to first token) = arrival of the first response that carries a token - send time.
- Request latency = arrival of the last response - send time.
- ITL (inter-token latency) of one request = (t_last_token - t_first_token) / (n_tokens - 1), where
  t_first_token / t_last_token are the arrivals of the first / last responses carrying tokens and
  n_tokens counts every token of every response. This is AIPerf's `(request_latency - ttft) /
  (output_sequence_length - 1)` with the request's end taken at its last token, so a response that
  carries k tokens counts as k tokens and a trailing empty "final" response does not inflate it.
  Undefined (left out) for requests with fewer than two tokens.
- Output token throughput = output tokens of all successful requests / benchmark duration, where the
  duration runs from the first send to the last response of the level. Request throughput likewise
  counts successful requests.
- Percentiles interpolate linearly between order statistics (numpy's default "linear" method).

Failed and timed-out requests are counted and listed by message, never dropped silently; they are
left out of the latency distributions (a failure has no meaningful latency) and the throughput.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class Chunk:
    """One streamed response: when it arrived (seconds, any monotonic clock) and its token count."""

    time: float
    num_tokens: int


@dataclass
class RequestTimeline:
    """Everything a load generator records about one request."""

    start: float  # send time, same clock as the chunks
    chunks: list[Chunk] = field(default_factory=list)
    error: str | None = None  # the server's or client's message; None when it succeeded
    timed_out: bool = False  # the client gave up waiting (also counted as an error)
    acceptance_length: float | None = None  # from the server's final response, when it sent one
    total_draft_tokens: int = 0
    total_accepted_draft_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out

    @property
    def output_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def end(self) -> float | None:
        return self.chunks[-1].time if self.chunks else None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; NaN for an empty sequence."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} is outside 0..100")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    """Summary of one metric over requests (seconds for latencies)."""

    count: int
    mean: float
    min: float
    max: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution:
        if not values:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan, nan)
        p50, p90, p99 = (percentile(values, q) for q in PERCENTILES)
        return cls(len(values), sum(values) / len(values), min(values), max(values), p50, p90, p99)


def ttft(t: RequestTimeline) -> float | None:
    """Time to first token: the first response that carries at least one token."""
    first = next((c for c in t.chunks if c.num_tokens > 0), None)
    return None if first is None else first.time - t.start


def request_latency(t: RequestTimeline) -> float | None:
    """Send to last response (None when nothing came back)."""
    return None if t.end is None else t.end - t.start


def inter_token_latency(t: RequestTimeline) -> float | None:
    """(t_last_token - t_first_token) / (n_tokens - 1); None with fewer than two tokens."""
    carrying = [c for c in t.chunks if c.num_tokens > 0]
    n = sum(c.num_tokens for c in carrying)
    if n < 2:
        return None
    return (carrying[-1].time - carrying[0].time) / (n - 1)


def inter_response_latency(t: RequestTimeline) -> float | None:
    """Mean gap between token-carrying responses: the stall a streaming reader sees."""
    carrying = [c for c in t.chunks if c.num_tokens > 0]
    if len(carrying) < 2:
        return None
    return (carrying[-1].time - carrying[0].time) / (len(carrying) - 1)


@dataclass(frozen=True)
class LevelStats:
    """All metrics of one load level (one concurrency, one mode)."""

    concurrency: int
    num_requests: int
    num_ok: int
    num_errors: int  # every failed request, timeouts included
    num_timeouts: int
    errors: dict[str, int]  # message -> count
    duration_s: float
    output_tokens: int
    output_token_throughput: float  # tokens/s over the level's duration
    request_throughput: float  # successful requests/s
    ttft: Distribution
    itl: Distribution
    inter_response: Distribution
    request_latency: Distribution
    output_tokens_per_request: Distribution
    tokens_per_response: float  # mean tokens a streamed response carried
    acceptance_length: float  # mean of the server-reported per-request acceptance_length

    def to_dict(self) -> dict:
        return asdict(self)


def _clean(values) -> list[float]:
    return [v for v in values if v is not None]


def summarize(timelines: Sequence[RequestTimeline], concurrency: int) -> LevelStats:
    """Aggregate one level's timelines into LevelStats (see the module docstring for definitions)."""
    ok = [t for t in timelines if t.ok]
    failed = [t for t in timelines if not t.ok]
    errors = Counter(t.error or "timeout" for t in failed)
    ends = _clean(t.end for t in timelines)
    duration = (max(ends) - min(t.start for t in timelines)) if ends else 0.0
    tokens = sum(t.output_tokens for t in ok)
    responses = sum(1 for t in ok for c in t.chunks if c.num_tokens > 0)
    accept = _clean(t.acceptance_length for t in ok)
    return LevelStats(
        concurrency=concurrency,
        num_requests=len(timelines),
        num_ok=len(ok),
        num_errors=len(failed),
        num_timeouts=sum(1 for t in failed if t.timed_out),
        errors=dict(errors.most_common()),
        duration_s=duration,
        output_tokens=tokens,
        output_token_throughput=tokens / duration if duration > 0 else math.nan,
        request_throughput=len(ok) / duration if duration > 0 else math.nan,
        ttft=Distribution.of(_clean(ttft(t) for t in ok)),
        itl=Distribution.of(_clean(inter_token_latency(t) for t in ok)),
        inter_response=Distribution.of(_clean(inter_response_latency(t) for t in ok)),
        request_latency=Distribution.of(_clean(request_latency(t) for t in ok)),
        output_tokens_per_request=Distribution.of([float(t.output_tokens) for t in ok]),
        tokens_per_response=tokens / responses if responses else math.nan,
        acceptance_length=sum(accept) / len(accept) if accept else math.nan,
    )


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator, NaN when either is missing or the denominator is 0."""
    if math.isnan(numerator) or math.isnan(denominator) or denominator == 0:
        return math.nan
    return numerator / denominator


@dataclass(frozen=True)
class Speedup:
    """DFlash against the baseline at one concurrency; > 1 means DFlash is better."""

    concurrency: int
    output_token_throughput: float  # dflash / baseline
    request_latency_p50: float  # baseline / dflash
    ttft_p50: float  # baseline / dflash
    itl_p50: float  # baseline / dflash


def speedup(dflash: LevelStats, baseline: LevelStats) -> Speedup:
    """Side-by-side ratios, oriented so that > 1 always favours DFlash."""
    return Speedup(
        concurrency=dflash.concurrency,
        output_token_throughput=ratio(dflash.output_token_throughput,
                                      baseline.output_token_throughput),
        request_latency_p50=ratio(baseline.request_latency.p50, dflash.request_latency.p50),
        ttft_p50=ratio(baseline.ttft.p50, dflash.ttft.p50),
        itl_p50=ratio(baseline.itl.p50, dflash.itl.p50),
    )
