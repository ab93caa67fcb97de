"""Where a decoding step's time goes: one target forward of one new token per row, plus the LM
head and argmax, over N rows of different lengths, with the linear layers timed apart.

    .venv/bin/python scripts/step_anatomy.py ENGINE_DIR [--rows 1,4,8] [--steps 20] [--ops]

For each row count: the mean (and median) step, and the mean milliseconds inside the linear
layers (the target's PackedLinear calls, LM head included) and outside them (attention, norms,
rotary, cache writes, Python). `--ops` also counts the top-level torch ops of one step. On a CPU the
linear layers stream every weight once per step whatever the row count, so their share says how
far a step is from the memory's limit; the rest is what fusing or leaner code could cut.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from dflash_trt.dflash import cpu_linear
from dflash_trt.engines import load_engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ops", action="store_true", help="count the top-level ops of a step")
    args = parser.parse_args()

    engine = load_engine(args.engine_dir)
    torch.set_num_threads(engine.threads or torch.get_num_threads())  # as the scheduler does
    inside = [0.0]
    forward = cpu_linear.PackedLinear.forward

    def timed(self, x):
        began = time.perf_counter()
        out = forward(self, x)
        inside[0] += time.perf_counter() - began
        return out

    cpu_linear.PackedLinear.forward = timed
    for rows in (int(n) for n in args.rows.split(",")):
        times, linear, ops = measure(engine.target, rows, args.steps, args.ops, inside)
        mean = statistics.mean(times)
        print(f"rows {rows}: step {1e3 * mean:.1f} ms (median {1e3 * statistics.median(times):.1f}"
              f" of {args.steps}): linear layers {1e3 * linear:.1f} ms, the rest "
              f"{1e3 * (mean - linear):.1f} ms (means)", flush=True)
        if ops:
            print(f"  {sum(ops.values())} top-level ops: " +
                  ", ".join(f"{name} {n}" for name, n in ops.most_common(8)))
    engine.close()


@torch.inference_mode()
def measure(target, rows: int, steps: int, count_ops: bool, inside: list[float]):
    """(step seconds, mean linear s, op counts or None) of `steps` decoding steps over `rows`
    rows whose contexts are 100, 107, 114, ... tokens long (rows of their own lengths, as a
    running batch has)."""
    kv = target.new_slot_cache(rows, 128 + 7 * rows + steps)
    for i in range(rows):
        n = 100 + 7 * i
        target.forward(torch.randint(100, 10000, (1, n)), kv.view(i, i + 1, n), False)
        kv.lengths[i] += n

    def step():
        hidden, _ = target.forward(torch.randint(100, 10000, (rows, 1)), kv.view(0, rows, 1),
                                   False)
        target.logits(hidden[:, -1]).argmax(-1)
        kv.lengths[:rows] = [n + 1 for n in kv.lengths[:rows]]

    step()  # warm
    times, inside[0] = [], 0.0
    for _ in range(steps):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    linear = inside[0] / steps
    ops = None
    if count_ops:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        ops = Counter(e.name for e in prof.events() if e.cpu_parent is None)
    return times, linear, ops


if __name__ == "__main__":
    main()
