"""The served-benchmark load generator against fake senders: no server, no clock asserts."""

from __future__ import annotations

import json
import threading

import pytest

from dflash_trt.bench.served import (
    BASELINE,
    DFLASH,
    BenchConfig,
    RequestTimeout,
    StreamEvent,
    median_speedup,
    modes_for_level,
    run_benchmark,
    run_level,
    timed_request,
    write_outputs,
)
from dflash_trt.errors import DflashTrtError


def fake_clock(start=0.0, step=1.0):
    t = [start - step]

    def clock():
        t[0] += step
        return t[0]
    return clock


def test_timed_request_stamps_every_response_and_keeps_the_server_stats():
    def send(prompt, options):
        yield StreamEvent(1)
        yield StreamEvent(4)
        yield StreamEvent(3, acceptance_length=2.5, total_draft_tokens=9,
                          total_accepted_draft_tokens=5)

    t = timed_request(send, "hi", options=None, clock=fake_clock())
    assert t.start == 0.0
    assert [(c.time, c.num_tokens) for c in t.chunks] == [(1.0, 1), (2.0, 4), (3.0, 3)]
    assert t.ok and t.output_tokens == 8
    assert (t.acceptance_length, t.total_draft_tokens, t.total_accepted_draft_tokens) == (2.5, 9, 5)


def test_timed_request_records_errors_and_timeouts_instead_of_raising():
    def fails(prompt, options):
        yield StreamEvent(1)
        raise RuntimeError("[StatusCode.INVALID_ARGUMENT] max_tokens must be >= 0\ndetails")

    def stalls(prompt, options):
        yield StreamEvent(2)
        raise RequestTimeout()

    bad = timed_request(fails, "x", None)
    assert not bad.ok and bad.error == "[StatusCode.INVALID_ARGUMENT] max_tokens must be >= 0"
    late = timed_request(stalls, "x", None)
    assert late.timed_out and not late.ok and late.output_tokens == 2


def test_run_level_keeps_concurrency_requests_in_flight_and_sends_every_request():
    concurrency, total = 3, 7
    # The first `concurrency` requests wait for each other: a generator that ran them one at a time
    # would break the barrier and turn them into errors.
    together = threading.Barrier(concurrency, timeout=30)
    lock = threading.Lock()
    state = {"in_flight": 0, "max": 0, "sent": 0, "senders": 0, "closed": 0}

    def make_sender():
        with lock:
            state["senders"] += 1

        def send(prompt, options):
            with lock:
                state["sent"] += 1
                first_round = state["sent"] <= concurrency
                state["in_flight"] += 1
                state["max"] = max(state["max"], state["in_flight"])
            try:
                if first_round:
                    together.wait()
                yield StreamEvent(len(prompt))
            finally:
                with lock:
                    state["in_flight"] -= 1

        def close():
            with lock:
                state["closed"] += 1
        return send, close

    done = []
    timelines = run_level(make_sender, ["a", "bb", "ccc"], concurrency=concurrency,
                          num_requests=total, options=None, on_done=done.append)
    assert len(timelines) == total == len(done)
    assert all(t.ok for t in timelines), [t.error for t in timelines]
    assert state["max"] == concurrency
    assert state["senders"] == state["closed"] == concurrency  # one connection per worker
    # Prompts cycle: request i uses prompt i % 3, whose length is its token count here.
    assert sorted(t.output_tokens for t in timelines) == sorted([1, 2, 3, 1, 2, 3, 1])


def test_run_level_counts_a_worker_whose_client_cannot_connect():
    def make_sender():
        raise ConnectionRefusedError("connection refused")

    timelines = run_level(make_sender, ["a"], concurrency=2, num_requests=4, options=None)
    assert len(timelines) == 4
    assert all(t.error == "client setup failed: connection refused" for t in timelines)


def test_modes_alternate_order_per_level():
    assert modes_for_level(0, False) == [DFLASH]
    assert modes_for_level(0, True) == [DFLASH, BASELINE]
    assert modes_for_level(1, True) == [BASELINE, DFLASH]


def spec_server(tokens_per_response):
    """A fake server: DFlash sends `tokens_per_response` tokens at once, the baseline one."""
    seen = []

    def make_sender():
        def send(prompt, options):
            seen.append(options.num_draft_tokens)
            if prompt == "boom":
                raise RuntimeError("model dflash: text_input must not be empty")
            k = 1 if options.num_draft_tokens == 0 else tokens_per_response
            for _ in range(options.max_tokens // k):
                yield StreamEvent(k, acceptance_length=float(k))
        return send, lambda: None
    return make_sender, seen


def test_benchmark_with_baseline_sends_num_draft_tokens_zero_and_reports_everything(tmp_path):
    make_sender, seen = spec_server(4)
    config = BenchConfig(concurrency=(1, 2), num_requests=4, max_tokens=8, warmup=1, baseline=True)
    levels = []
    result = run_benchmark(make_sender, ["p1", "boom", "p2", "p3"], config, meta={"url": "fake"},
                           on_level=lambda *a: levels.append(a))

    assert levels[:2] == [("dflash warm-up", 0, 1), ("baseline warm-up", 0, 1)]
    assert [(m, c) for m, c, _ in levels[2:]] == [(DFLASH, 1), (BASELINE, 1), (BASELINE, 2),
                                                  (DFLASH, 2)]
    assert seen.count(0) == 1 + 8 and seen.count(None) == 1 + 8
    for mode in (DFLASH, BASELINE):
        for s in result.stats(mode):
            assert (s.num_requests, s.num_ok, s.num_errors) == (4, 3, 1)
            assert s.errors == {"model dflash: text_input must not be empty": 1}
            assert s.output_tokens == 24
    assert [s.acceptance_length for s in result.stats(DFLASH)] == [4.0, 4.0]
    assert [s.tokens_per_response for s in result.stats(BASELINE)] == [1.0, 1.0]
    assert [s.concurrency for s in result.speedups] == [1, 2]

    paths = write_outputs(result, tmp_path)
    data = json.loads(paths[0].read_text())
    assert [(lv["mode"], lv["concurrency"]) for lv in data["levels"]] == [
        (DFLASH, 1), (BASELINE, 1), (BASELINE, 2), (DFLASH, 2)]
    assert len(data["speedups"]) == 2 and "itl" in data["definitions"]
    text = paths[1].read_text()
    assert "**4 requests failed:**" in text and "text_input must not be empty" in text
    assert "DFlash vs the same model with `num_draft_tokens=0`" in text
    for png in paths[2:]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_repeats_run_back_to_back_in_alternating_order_and_the_speedup_is_their_median(tmp_path):
    make_sender, _ = spec_server(4)
    config = BenchConfig(concurrency=(1, 2), num_requests=2, max_tokens=8, warmup=0,
                         baseline=True, repeats=3)
    levels = []
    result = run_benchmark(make_sender, ["p"], config, meta={},
                           on_level=lambda mode, c, n: levels.append((mode, c)))

    D, B = DFLASH, BASELINE
    assert levels == [(D, 1), (B, 1), (B, 1), (D, 1), (D, 1), (B, 1),
                      (B, 2), (D, 2), (D, 2), (B, 2), (B, 2), (D, 2)]
    assert [(lv.mode, lv.repeat) for lv in result.levels[:4]] == [(D, 0), (B, 0), (B, 1), (D, 1)]
    assert [s.concurrency for s in result.repeat_speedups] == [1, 1, 1, 2, 2, 2]
    assert [s.concurrency for s in result.speedups] == [1, 2]
    assert len(result.stats(DFLASH)) == 2  # one run per level: its median one
    for c in (1, 2):
        each = sorted(s.output_token_throughput for s in result.repeat_speedups
                      if s.concurrency == c)
        assert result.speedups[c - 1].output_token_throughput == each[1]
    text = write_outputs(result, tmp_path)[1].read_text()
    assert "3 run(s) per level and mode" in text and "medians over a level's repeats" in text


def test_median_speedup_takes_each_ratio_s_median_and_nan_when_a_repeat_lacks_it():
    from dflash_trt.bench.metrics import Speedup

    runs = [Speedup(4, 1.10, 1.0, 2.0, 0.9), Speedup(4, 0.90, 1.2, float("nan"), 1.1),
            Speedup(4, 1.00, 0.8, 1.0, 1.0)]
    median = median_speedup(runs)
    assert (median.concurrency, median.output_token_throughput, median.request_latency_p50,
            median.itl_p50) == (4, 1.00, 1.0, 1.0)
    assert median.ttft_p50 != median.ttft_p50  # NaN


def test_benchmark_stops_early_when_every_warmup_request_fails():
    def make_sender():
        def send(prompt, options):
            raise ConnectionError("failed to connect to all addresses")
            yield  # pragma: no cover
        return send, lambda: None

    with pytest.raises(DflashTrtError, match="every dflash warm-up request failed"):
        run_benchmark(make_sender, ["p"], BenchConfig(warmup=2), meta={})


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "1,0"], "every concurrency must be >= 1"),
    (["--concurrency", "1,x"], "not a comma-separated list of integers"),
    (["--concurrency", "2,2"], "concurrency levels repeat"),
    (["--url", "http://localhost:8000"], "expected HOST:PORT"),
    (["--prompts", "builtin:nope"], "unknown prompt set"),
])
def test_bench_command_rejects_bad_input_with_exit_2(args, message):
    from click.testing import CliRunner

    from dflash_trt.cli import cli

    base = {"--url": "localhost:8001", "--prompts": "builtin:chat"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    argv = ["bench", *[x for kv in base.items() for x in kv]]
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 2, result.output
    assert message in result.output
