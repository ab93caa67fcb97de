"""Serving metric definitions on synthetic timelines (hand-computed expectations)."""

from __future__ import annotations

import math

import pytest

from dflash_trt.bench.metrics import (
    Chunk,
    Distribution,
    RequestTimeline,
    inter_response_latency,
    inter_token_latency,
    percentile,
    request_latency,
    speedup,
    summarize,
    ttft,
)


def timeline(start, *chunks, **kw) -> RequestTimeline:
    return RequestTimeline(start=start, chunks=[Chunk(t, n) for t, n in chunks], **kw)


def test_ttft_is_the_first_response_that_carries_a_token():
    # An empty first response (e.g. a header) must not count as the first token.
    t = timeline(10.0, (10.5, 0), (11.0, 1), (12.0, 1))
    assert ttft(t) == pytest.approx(1.0)
    assert request_latency(t) == pytest.approx(2.0)


def test_itl_counts_every_token_of_a_multi_token_response():
    # 1 token at t=1, then 4 tokens at t=2, then 3 tokens at t=3: 8 tokens over 2 s -> 2/7 s.
    t = timeline(0.0, (1.0, 1), (2.0, 4), (3.0, 3))
    assert inter_token_latency(t) == pytest.approx(2.0 / 7.0)
    # Per response the reader waits 1 s: the gap between responses, not per token.
    assert inter_response_latency(t) == pytest.approx(1.0)


def test_itl_matches_one_token_per_response_when_steps_are_single_tokens():
    t = timeline(0.0, (1.0, 1), (1.5, 1), (2.0, 1), (2.5, 1))
    assert inter_token_latency(t) == pytest.approx(0.5)
    assert inter_response_latency(t) == pytest.approx(0.5)


def test_itl_ignores_a_trailing_empty_final_response():
    t = timeline(0.0, (1.0, 2), (2.0, 2), (9.0, 0))
    assert inter_token_latency(t) == pytest.approx(1.0 / 3.0)
    assert request_latency(t) == pytest.approx(9.0)


def test_itl_undefined_below_two_tokens():
    assert inter_token_latency(timeline(0.0, (1.0, 1))) is None
    assert inter_token_latency(timeline(0.0)) is None
    # Two tokens in one response: defined, and zero (they arrived together).
    assert inter_token_latency(timeline(0.0, (1.0, 2))) == 0.0


def test_percentile_linear_interpolation():
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    # rank = 3 * 0.9 = 2.7 -> 3 + 0.7 * (4 - 3)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_distribution_summary():
    d = Distribution.of([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (d.count, d.mean, d.min, d.max, d.p50) == (5, 3.0, 1.0, 5.0, 3.0)
    assert d.p90 == pytest.approx(4.6)
    assert Distribution.of([]).count == 0 and math.isnan(Distribution.of([]).p99)


def test_summarize_counts_errors_and_timeouts_and_excludes_them_from_latency():
    good_a = timeline(0.0, (1.0, 1), (2.0, 3), acceptance_length=2.0)  # 4 tokens, latency 2
    good_b = timeline(0.5, (1.0, 2), (4.0, 2), acceptance_length=3.0)  # 4 tokens, latency 3.5
    failed = timeline(0.2, (0.3, 1), error="model dflash: max_tokens must be >= 0")
    failed_too = timeline(0.3, error="model dflash: max_tokens must be >= 0")
    late = timeline(0.4, (0.6, 1), timed_out=True)
    stats = summarize([good_a, good_b, failed, failed_too, late], concurrency=2)

    assert stats.num_requests == 5
    assert stats.num_ok == 2
    assert stats.num_errors == 3
    assert stats.num_timeouts == 1
    assert stats.errors == {"model dflash: max_tokens must be >= 0": 2, "timeout": 1}
    # Throughput counts the successful requests' tokens over first send .. last response.
    assert stats.duration_s == pytest.approx(4.0)
    assert stats.output_tokens == 8
    assert stats.output_token_throughput == pytest.approx(2.0)
    assert stats.request_throughput == pytest.approx(0.5)
    # Latencies come only from the two good requests.
    assert stats.request_latency.count == 2
    assert stats.request_latency.max == pytest.approx(3.5)
    assert stats.ttft.mean == pytest.approx((1.0 + 0.5) / 2)
    assert stats.itl.mean == pytest.approx((1.0 / 3 + 3.0 / 3) / 2)
    assert stats.tokens_per_response == pytest.approx(2.0)
    assert stats.acceptance_length == pytest.approx(2.5)


def test_summarize_with_every_request_failed_is_reported_not_crashed():
    stats = summarize([timeline(0.0, error="connection refused")] * 3, concurrency=1)
    assert (stats.num_ok, stats.num_errors) == (0, 3)
    assert stats.errors == {"connection refused": 3}
    assert stats.output_tokens == 0 and stats.ttft.count == 0


def test_speedup_is_oriented_so_bigger_favours_dflash():
    fast = summarize([timeline(0.0, (0.1, 1), (0.5, 9))], concurrency=1)  # 10 tokens in 0.5 s
    slow = summarize([timeline(0.0, (0.1, 1), *[(0.1 * (i + 2), 1) for i in range(9)])], 1)
    s = speedup(fast, slow)  # slow: 10 tokens in 1.0 s
    assert s.output_token_throughput == pytest.approx(2.0)
    assert s.request_latency_p50 == pytest.approx(2.0)
    assert s.ttft_p50 == pytest.approx(1.0)
    assert s.itl_p50 == pytest.approx((0.9 / 9) / (0.4 / 9))
