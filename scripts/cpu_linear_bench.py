"""Time one SmolLM2-135M projection (576 -> 1536) for 1..512 rows: PyTorch's default CPU matmul and
oneDNN with a packed weight (dflash/cpu_linear.py), both float32, against the float16 kernels for
NVFP4 weights (dflash/cpu_fp16.py: the AVX2 one, the AVX-512 one where the CPU has AVX-512F, the
AMX bfloat16 one where it has AMX).
Microseconds per call, the best of 3 interleaved rounds.

    .venv/bin/python scripts/cpu_linear_bench.py [THREADS] [--copies N]

Each kernel cycles through N copies of the weight (default 40, 35 MB in float32), so that the
weights come from memory as in a model's step, not from a cache that holds one layer.
"""

import argparse
import time

import torch

from dflash_trt.dflash import cpu_fp16, cpu_linear
from dflash_trt.formats import qformats

parser = argparse.ArgumentParser()
parser.add_argument("threads", type=int, nargs="?", default=torch.get_num_threads())
parser.add_argument("--copies", type=int, default=40)
args = parser.parse_args()
torch.set_num_threads(args.threads)
torch.manual_seed(0)
layers = []
for _ in range(args.copies):
    stored = qformats.nvfp4_quantize(torch.randn(1536, 576) * 0.05)
    dense = qformats.nvfp4_dequantize(stored.packed, stored.weight_scale, stored.weight_scale_2)
    layers.append((dense, cpu_linear.pack(dense),
                   {isa: cpu_fp16.blocked(stored.unscaled(), isa) for isa in cpu_fp16.kernels()},
                   float(stored.weight_scale_2)))
kernels = cpu_fp16.kernels()  # each timed by making it the one cpu_fp16 loaded


def kernel_micros(isa, kernel, x) -> float:
    cpu_fp16._kernel = kernel
    return micros(lambda w: cpu_fp16.linear(x, w[2][isa], w[3]))


def micros(fn) -> float:
    """Microseconds per call of fn over every copy, best of 3 rounds of 5 passes."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(5):
            for layer in layers:
                fn(layer)
        best = min(best, (time.perf_counter() - start) / (5 * len(layers)) * 1e6)
    return best


heads = "".join(f" {'bfloat16' if name == 'amx' else 'float16'} {name} (us) |" for name in kernels)
print(f"threads {torch.get_num_threads()}, {args.copies} copies\n"
      f"| rows | default float32 (us) | oneDNN packed float32 (us) |{heads}\n"
      f"|---|---|---|{'---|' * len(kernels)}")
for rows in (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512):
    x = torch.randn(rows, 576)
    default = micros(lambda w, x=x: torch.nn.functional.linear(x, w[0]))
    onednn = micros(lambda w, x=x: cpu_linear.packed_linear(x, w[1], None))
    cells = "".join(f" {kernel_micros(isa, k, x):.0f} |" for isa, k in kernels.items())
    print(f"| {rows} | {default:.0f} | {onednn:.0f} |{cells}", flush=True)
