"""Time one SmolLM2-135M projection (576 -> 1536, float32) for 1..16 rows: PyTorch's default CPU
matmul against oneDNN with a packed weight (dflash/cpu_linear.py). Microseconds per call.

    .venv/bin/python scripts/cpu_linear_bench.py [THREADS]
"""

import sys
import time

import torch

from dflash_trt.dflash import cpu_linear

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads())
weight = torch.randn(1536, 576)
packed = cpu_linear.pack(weight)


def micros(fn, calls: int = 200) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


print(f"threads {torch.get_num_threads()}\n| rows | default (us) | oneDNN packed (us) |\n|---|---|---|")
for rows in (1, 2, 4, 8, 16):
    x = torch.randn(rows, 576)
    default = micros(lambda x=x: torch.nn.functional.linear(x, weight))
    onednn = micros(lambda x=x: cpu_linear.packed_linear(x, packed, None))
    print(f"| {rows} | {default:.0f} | {onednn:.0f} |")
