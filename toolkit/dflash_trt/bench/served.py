"""Served benchmark: a closed-loop streaming load generator against a Triton `dflash` model.

For each concurrency level, `concurrency` workers each keep exactly one streaming request in
flight until the level's `num_requests` have been sent (closed loop, like GenAI-Perf's
`--concurrency`). Each worker owns its own client (a gRPC stream carries one request at a time),
connected before the level starts so connection set-up is not measured. Every streamed response is
timestamped on arrival; bench.metrics turns the timelines into TTFT, ITL, latency and throughput.

With a baseline, every level runs twice on the same server: DFlash (the server's default number of
draft tokens) and the same model with `num_draft_tokens=0`. The two runs of a level are back to
back and their order alternates from run to run, so slow drift of a shared machine does not
favour one mode. With repeats, every level runs that many times per mode, back to back in that
alternating order (D B, B D, ...), and the speedup of a level is the median of its repeats' ratios:
on a machine whose speed drifts between runs, one pair of runs per level decides nothing close.

No torch here: tritonclient via dflash_trt.serving.client, matplotlib only when plots are written.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from dflash_trt.bench.metrics import (
    Chunk,
    LevelStats,
    RequestTimeline,
    Speedup,
    speedup,
    summarize,
)
from dflash_trt.errors import DflashTrtError

DFLASH = "dflash"
BASELINE = "baseline"


@dataclass(frozen=True)
class RequestOptions:
    """Per-request settings sent with every prompt of a run."""

    max_tokens: int
    temperature: float = 0.0
    num_draft_tokens: int | None = None  # None = the server's default; 0 = no speculation
    timeout_s: float = 600.0  # seconds without a response before the request is a timeout


@dataclass(frozen=True)
class StreamEvent:
    """One streamed response as the load generator needs it."""

    num_tokens: int  # new tokens in this response
    acceptance_length: float | None = None  # the server's running/final statistics, if present
    total_draft_tokens: int | None = None
    total_accepted_draft_tokens: int | None = None


class RequestTimeout(Exception):
    """Raised by a sender when a request exceeds its timeout."""


# A Sender streams one request: prompt and options in, StreamEvents out as responses arrive.
# It raises RequestTimeout on timeout and any other exception on a failed request.
Sender = Callable[[str, RequestOptions], Iterator[StreamEvent]]


def _error_message(exc: BaseException) -> str:
    # Group identical failures: one line, without per-request ids where tritonclient adds them.
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:300]


def timed_request(send: Sender, prompt: str, options: RequestOptions,
                  clock: Callable[[], float] = time.perf_counter) -> RequestTimeline:
    """Send one request and timestamp every response; failures are recorded, never raised."""
    timeline = RequestTimeline(start=clock())
    try:
        for event in send(prompt, options):
            timeline.chunks.append(Chunk(clock(), event.num_tokens))
            if event.acceptance_length is not None:
                timeline.acceptance_length = event.acceptance_length
            if event.total_draft_tokens is not None:
                timeline.total_draft_tokens = event.total_draft_tokens
            if event.total_accepted_draft_tokens is not None:
                timeline.total_accepted_draft_tokens = event.total_accepted_draft_tokens
    except RequestTimeout:
        timeline.timed_out = True
    except Exception as exc:  # noqa: BLE001 - every failure is counted, with its message
        timeline.error = _error_message(exc)
    return timeline


def run_level(make_sender: Callable[[], tuple[Sender, Callable[[], None]]],
              prompts: Sequence[str], *, concurrency: int, num_requests: int,
              options: RequestOptions,
              on_done: Callable[[RequestTimeline], None] | None = None) -> list[RequestTimeline]:
    """Closed loop: `concurrency` workers send `num_requests` prompts (cycling through prompts).

    make_sender() returns (sender, close) for one worker's own connection.
    """
    if concurrency < 1 or num_requests < 1:
        raise ValueError("concurrency and num_requests must be >= 1")
    workers = min(concurrency, num_requests)
    counter = itertools.count()
    lock = threading.Lock()
    timelines: list[RequestTimeline | None] = [None] * num_requests
    ready = threading.Barrier(workers)
    setup_errors: list[BaseException] = []

    def worker() -> None:
        sender, close = None, None
        try:
            sender, close = make_sender()
        except Exception as exc:  # noqa: BLE001 - reported below, after the barrier
            setup_errors.append(exc)
        try:
            ready.wait()  # all workers connected: start the level together
            while True:
                with lock:
                    i = next(counter)
                if i >= num_requests:
                    return
                if sender is None:
                    t = RequestTimeline(start=time.perf_counter(),
                                        error=f"client setup failed: {_error_message(setup_errors[0])}")
                else:
                    t = timed_request(sender, prompts[i % len(prompts)], options)
                timelines[i] = t
                if on_done is not None:
                    on_done(t)
        finally:
            if close is not None:
                close()

    threads = [threading.Thread(target=worker, name=f"bench-{k}", daemon=True)
               for k in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [t for t in timelines if t is not None]


@dataclass(frozen=True)
class BenchConfig:
    """What to run: the load, the prompts and the request settings."""

    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    num_requests: int = 32  # per level and mode
    max_tokens: int = 128
    warmup: int = 2  # requests per mode before the sweep, not measured
    baseline: bool = False
    temperature: float = 0.0
    timeout_s: float = 600.0
    repeats: int = 1  # runs per level and mode


@dataclass
class LevelResult:
    """One (mode, concurrency, repeat) run."""

    mode: str
    stats: LevelStats
    repeat: int = 0


@dataclass
class BenchResult:
    """The whole sweep, with speedups when a baseline ran."""

    meta: dict
    levels: list[LevelResult] = field(default_factory=list)
    speedups: list[Speedup] = field(default_factory=list)  # per level: medians over its repeats
    repeat_speedups: list[Speedup] = field(default_factory=list)  # per level and repeat

    def stats(self, mode: str) -> list[LevelStats]:
        """Per level, the run of the mode's median output throughput over its repeats (the
        lower middle one of an even number)."""
        by_level: dict[int, list[LevelStats]] = {}
        for lv in self.levels:
            if lv.mode == mode:
                by_level.setdefault(lv.stats.concurrency, []).append(lv.stats)
        return [sorted(runs, key=lambda s: s.output_token_throughput)[(len(runs) - 1) // 2]
                for runs in by_level.values()]

    @property
    def num_errors(self) -> int:
        return sum(lv.stats.num_errors for lv in self.levels)

    def to_dict(self) -> dict:
        return {
            "meta": self.meta,
            "definitions": DEFINITIONS,
            "levels": [{"mode": lv.mode, "repeat": lv.repeat, **lv.stats.to_dict()}
                       for lv in self.levels],
            "speedups": [asdict(s) for s in self.speedups],
            "repeat_speedups": [asdict(s) for s in self.repeat_speedups],
        }


DEFINITIONS = {
    "ttft": "send -> first response carrying a token (s)",
    "itl": "(t_last_token - t_first_token) / (n_tokens - 1) per request; a response carrying k "
           "tokens counts as k tokens (GenAI-Perf/AIPerf) (s)",
    "inter_response": "mean gap between token-carrying responses per request (s)",
    "request_latency": "send -> last response (s)",
    "output_token_throughput": "output tokens of successful requests / (first send -> last "
                               "response of the level) (tokens/s)",
    "request_throughput": "successful requests / level duration (requests/s)",
    "acceptance_length": "mean over successful requests of the server's acceptance_length",
    "percentiles": "linear interpolation between order statistics",
    "errors": "failed and timed-out requests, by message; excluded from latencies and throughput",
}


def modes_for_level(index: int, baseline: bool) -> list[str]:
    """DFlash alone, or both modes with the order alternating from run to run (index: the
    run's number in the sweep, counting each level's repeats)."""
    if not baseline:
        return [DFLASH]
    return [DFLASH, BASELINE] if index % 2 == 0 else [BASELINE, DFLASH]


def options_for(mode: str, config: BenchConfig) -> RequestOptions:
    return RequestOptions(max_tokens=config.max_tokens, temperature=config.temperature,
                          num_draft_tokens=0 if mode == BASELINE else None,
                          timeout_s=config.timeout_s)


def run_benchmark(make_sender: Callable[[], tuple[Sender, Callable[[], None]]],
                  prompts: Sequence[str], config: BenchConfig, meta: dict, *,
                  on_level: Callable[[str, int, int], None] | None = None,
                  on_done: Callable[[RequestTimeline], None] | None = None) -> BenchResult:
    """Warm up, then sweep the concurrency levels (both modes with a baseline).

    on_level(mode, concurrency, num_requests) announces each level (warm-up has concurrency 0).
    """
    if not prompts:
        raise DflashTrtError("no prompts to send; choose a non-empty prompt set")
    result = BenchResult(meta={**meta, "config": asdict(config)})
    modes = [DFLASH, BASELINE] if config.baseline else [DFLASH]
    for mode in modes:
        if config.warmup <= 0:
            continue
        if on_level is not None:
            on_level(f"{mode} warm-up", 0, config.warmup)
        warm = run_level(make_sender, prompts, concurrency=1, num_requests=config.warmup,
                         options=options_for(mode, config), on_done=on_done)
        if not any(t.ok for t in warm):
            first = warm[0]
            raise DflashTrtError(f"every {mode} warm-up request failed "
                                 f"({first.error or 'timeout'}); check the server and --url")
    runs = itertools.count()
    for concurrency in config.concurrency:
        for repeat in range(config.repeats):
            pair = {}
            for mode in modes_for_level(next(runs), config.baseline):
                if on_level is not None:
                    on_level(mode, concurrency, config.num_requests)
                timelines = run_level(make_sender, prompts, concurrency=concurrency,
                                      num_requests=config.num_requests,
                                      options=options_for(mode, config), on_done=on_done)
                pair[mode] = summarize(timelines, concurrency)
                result.levels.append(LevelResult(mode, pair[mode], repeat))
            if config.baseline:
                result.repeat_speedups.append(speedup(pair[DFLASH], pair[BASELINE]))
    result.speedups = [median_speedup([s for s in result.repeat_speedups if s.concurrency == c])
                       for c in config.concurrency] if config.baseline else []
    return result


def median_speedup(repeats: Sequence[Speedup]) -> Speedup:
    """Each ratio's median over a level's repeats (NaN where a repeat had none)."""
    def median(name: str) -> float:
        values = [getattr(s, name) for s in repeats]
        return math.nan if any(math.isnan(v) for v in values) else statistics.median(values)

    return Speedup(concurrency=repeats[0].concurrency,
                   **{f.name: median(f.name) for f in fields(Speedup) if f.name != "concurrency"})


# --- the tritonclient sender -------------------------------------------------------------------


def triton_sender_factory(url: str, protocol: str, model_name: str):
    """make_sender for run_level: one dflash_trt.serving.client connection per worker."""
    import dflash_trt.serving.client  # noqa: F401 - fail here, once, if tritonclient is missing

    def make_sender():
        return triton_sender(url, protocol=protocol, model_name=model_name)

    return make_sender


def triton_sender(url: str, *, protocol: str, model_name: str):
    """(sender, close): a Sender over one tritonclient connection (gRPC or HTTP streaming)."""
    from dflash_trt.serving.client import GenerateRequest, TritonTimeoutError, connect

    client = connect(url, protocol, model_name)

    def send(prompt: str, options: RequestOptions) -> Iterator[StreamEvent]:
        client.timeout_s = options.timeout_s
        request = GenerateRequest(prompt=prompt, max_tokens=options.max_tokens,
                                  temperature=options.temperature,
                                  num_draft_tokens=options.num_draft_tokens)
        try:
            for chunk in client.stream(request):
                yield StreamEvent(num_tokens=len(chunk.token_ids),
                                  acceptance_length=chunk.acceptance_length,
                                  total_draft_tokens=chunk.total_draft_tokens,
                                  total_accepted_draft_tokens=chunk.total_accepted_draft_tokens)
        except TritonTimeoutError as exc:
            raise RequestTimeout(str(exc)) from None

    return send, client.close


# --- outputs -----------------------------------------------------------------------------------


def _f(x: float, scale: float = 1.0, spec: str = ".1f") -> str:
    return "n/a" if x is None or math.isnan(x) else format(x * scale, spec)


def markdown(result: BenchResult) -> str:
    """Per-level metrics table, then the speedup table when a baseline ran."""
    meta = result.meta
    cfg = meta.get("config", {})
    lines = ["## Served benchmark", "",
             f"Server `{meta.get('url')}` ({meta.get('protocol')}), model `{meta.get('model')}`, "
             f"prompts `{meta.get('prompts')}`, {cfg.get('num_requests')} requests per level, "
             f"{cfg.get('repeats', 1)} run(s) per level and mode, "
             f"max_tokens {cfg.get('max_tokens')}, temperature {cfg.get('temperature')}, "
             f"streaming. Latencies in ms (request latency in s).", "",
             "| mode | concurrency | repeat | ok | errors (timeouts) | output tok/s | req/s "
             "| TTFT p50 "
             "| TTFT p99 | ITL p50 | ITL p99 | latency p50 | latency p90 | latency p99 "
             "| tokens/response | acceptance length |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for lv in sorted(result.levels,
                     key=lambda lv: (lv.stats.concurrency, lv.mode != DFLASH, lv.repeat)):
        s = lv.stats
        lines.append(
            f"| {lv.mode} | {s.concurrency} | {lv.repeat} | {s.num_ok}/{s.num_requests} "
            f"| {s.num_errors} ({s.num_timeouts}) | {_f(s.output_token_throughput)} "
            f"| {_f(s.request_throughput, spec='.2f')} | {_f(s.ttft.p50, 1e3)} "
            f"| {_f(s.ttft.p99, 1e3)} | {_f(s.itl.p50, 1e3)} | {_f(s.itl.p99, 1e3)} "
            f"| {_f(s.request_latency.p50, spec='.2f')} | {_f(s.request_latency.p90, spec='.2f')} "
            f"| {_f(s.request_latency.p99, spec='.2f')} | {_f(s.tokens_per_response, spec='.2f')} "
            f"| {_f(s.acceptance_length, spec='.2f')} |")
    if result.speedups:
        lines += ["", "DFlash vs the same model with `num_draft_tokens=0` (> 1 favours DFlash; "
                  "medians over a level's repeats):", "",
                  "| concurrency | output tok/s | request latency p50 | TTFT p50 | ITL p50 "
                  "| output tok/s per repeat |",
                  "|---|---|---|---|---|---|"]
        for s in result.speedups:
            each = [r.output_token_throughput for r in result.repeat_speedups
                    if r.concurrency == s.concurrency]
            lines.append(f"| {s.concurrency} | {_f(s.output_token_throughput, spec='.3f')}x "
                         f"| {_f(s.request_latency_p50, spec='.2f')}x "
                         f"| {_f(s.ttft_p50, spec='.2f')}x | {_f(s.itl_p50, spec='.2f')}x "
                         f"| {', '.join(_f(x, spec='.3f') for x in each)} |")
    errors = [(lv.mode, lv.stats) for lv in result.levels if lv.stats.num_errors]
    if errors:
        lines += ["", f"**{result.num_errors} requests failed:**"]
        for mode, s in errors:
            lines += [f"- {mode} @ {s.concurrency}: {n} x {msg}" for msg, n in s.errors.items()]
    return "\n".join(lines) + "\n"


def write_outputs(result: BenchResult, out_dir: Path) -> list[Path]:
    """bench.json, bench.md, throughput.png and latency.png under out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / n for n in ("bench.json", "bench.md", "throughput.png", "latency.png")]
    paths[0].write_text(json.dumps(result.to_dict(), indent=2, default=str))
    paths[1].write_text(markdown(result))
    _plot(result, paths[2], paths[3])
    return paths


def _plot(result: BenchResult, throughput_path: Path, latency_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    modes = [m for m in (DFLASH, BASELINE) if result.stats(m)]
    style = {DFLASH: dict(color="C1", marker="o"), BASELINE: dict(color="C0", marker="s")}

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for mode in modes:
        stats = result.stats(mode)
        xs = [s.concurrency for s in stats]
        axes[0].plot(xs, [s.output_token_throughput for s in stats], label=mode, **style[mode])
        axes[1].plot(xs, [s.request_throughput for s in stats], label=mode, **style[mode])
    levels = sorted({lv.stats.concurrency for lv in result.levels})
    for ax, ylabel in zip(axes, ("output tokens/s", "requests/s"), strict=True):
        _axis(ax, ylabel, levels)
    fig.suptitle("Throughput vs concurrency")
    fig.tight_layout()
    fig.savefig(throughput_path, dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for mode in modes:
        stats = result.stats(mode)
        xs = [s.concurrency for s in stats]
        axes[0].plot(xs, [s.ttft.p50 * 1e3 for s in stats], label=f"{mode} p50", **style[mode])
        axes[1].plot(xs, [s.itl.p50 * 1e3 for s in stats], label=f"{mode} p50", **style[mode])
        axes[2].plot(xs, [s.request_latency.p50 for s in stats], label=f"{mode} p50",
                     **style[mode])
        axes[2].plot(xs, [s.request_latency.p99 for s in stats], label=f"{mode} p99",
                     linestyle="--", **style[mode])
    ylabels = ("TTFT (ms)", "inter-token latency (ms)", "request latency (s)")
    for ax, ylabel in zip(axes, ylabels, strict=True):
        _axis(ax, ylabel, levels)
    fig.suptitle("Latency vs concurrency")
    fig.tight_layout()
    fig.savefig(latency_path, dpi=120)
    plt.close(fig)


def _axis(ax, ylabel: str, levels: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])  # 1, 2, 4, 8 rather than 2^k
    ax.minorticks_off()
    ax.set_ylim(bottom=0)
    ax.set_xlabel("concurrency")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend()
