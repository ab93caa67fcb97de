"""Summarise scripts/aiperf_cpu.sh runs: output tokens/s and TTFT p50 per concurrency level, and
each level against the lowest one, per repeat and as medians (the ratios #17's check reads).

    python3 scripts/aiperf_summary.py build/bench/aiperf-s17

OUT holds c<N>/ (one repeat) or r<i>/c<N>/ (REPEATS > 1), each with AIPerf's
profile_export_aiperf.json. Standard library only: it runs with any python3.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path


def read_level(path: Path) -> dict:
    """Throughput, TTFT p50, requests and errors of one AIPerf export."""
    data = json.loads(path.read_text())
    errors = data.get("error_summary") or []
    return {"tok_s": data["output_token_throughput"]["avg"],
            "ttft_p50": data["time_to_first_token"]["p50"],
            "requests": int(data["request_count"]["avg"]),
            "errors": sum(int(e.get("count", 1)) for e in errors)}


def read_runs(out: Path) -> list[dict[int, dict]]:
    """One {concurrency: level} per repeat, in repeat order."""
    dirs = sorted((p for p in out.glob("r*") if re.fullmatch(r"r\d+", p.name)),
                  key=lambda p: int(p.name[1:])) or [out]
    runs = []
    for run in dirs:
        levels = {int(p.parent.name[1:]): read_level(p)
                  for p in run.glob("c*/profile_export_aiperf.json")
                  if re.fullmatch(r"c\d+", p.parent.name)}
        if levels:
            runs.append(levels)
    if not runs:
        raise SystemExit(f"{out}: no c<N>/profile_export_aiperf.json (run scripts/aiperf_cpu.sh "
                         "with OUT set to it first)")
    return runs


def summary(runs: list[dict[int, dict]]) -> str:
    levels = sorted(set.intersection(*(set(run) for run in runs)))
    low = levels[0]
    lines = ["| repeat | " + " | ".join(f"c{c} tok/s, TTFT p50 ms" for c in levels) + " | "
             + " | ".join(f"c{c} / c{low} tok/s, TTFT" for c in levels[1:]) + " | errors |",
             "|---" * (len(levels) * 2 + 1) + "|"]
    ratios = {c: ([], []) for c in levels[1:]}
    for i, run in enumerate(runs, 1):
        cells = [f"{run[c]['tok_s']:.1f}, {run[c]['ttft_p50']:.0f}" for c in levels]
        for c in levels[1:]:
            ratios[c][0].append(run[c]["tok_s"] / run[low]["tok_s"])
            ratios[c][1].append(run[c]["ttft_p50"] / run[low]["ttft_p50"])
            cells.append(f"{ratios[c][0][-1]:.2f}x, {ratios[c][1][-1]:.2f}x")
        errors = sum(run[c]["errors"] for c in levels)
        requests = "/".join(str(run[c]["requests"]) for c in levels)
        lines.append(f"| {i} | " + " | ".join(cells) + f" | {errors} ({requests} requests) |")
    medians = [f"{statistics.median(r[c]['tok_s'] for r in runs):.1f}, "
               f"{statistics.median(r[c]['ttft_p50'] for r in runs):.0f}" for c in levels]
    medians += [f"**{statistics.median(t):.2f}x**, {statistics.median(f):.2f}x"
                for t, f in ratios.values()]
    lines.append("| median | " + " | ".join(medians) + " | |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: aiperf_summary.py OUT (the OUT of scripts/aiperf_cpu.sh)")
    print(summary(read_runs(Path(sys.argv[1]))))


if __name__ == "__main__":
    main()
