"""Time one SmolLM2-135M attention layer (9 query heads, 3 KV heads, head dim 64, float32) over a
slot cache (dflash/slots.py) with a per-row mask: transformers' sdpa path (grouped KV heads copied
out to every query head) against torch's sdpa keeping the groups (dflash/attention.py gqa_sdpa),
and the same without a mask. Microseconds per call, median of 200.

    .venv/bin/python scripts/attention_bench.py [THREADS]
"""

import statistics
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads())


def micros(fn, calls: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


print(f"threads {torch.get_num_threads()}\n| rows | new tokens | keys | copied heads + mask (us) "
      "| grouped + mask (us) | grouped, no mask (us) |\n|---|---|---|---|---|---|")
def copied(q, k, v, mask):
    """transformers' sdpa with a mask: every query head gets its own copy of its KV group."""
    rows, groups, keys, dim = k.shape
    repeat = q.shape[1] // groups
    kk = k[:, :, None].expand(rows, groups, repeat, keys, dim).reshape(rows, -1, keys, dim)
    vv = v[:, :, None].expand(rows, groups, repeat, keys, dim).reshape(rows, -1, keys, dim)
    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)


def grouped(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


for rows, width, keys in [(1, 1, 160), (4, 1, 160), (4, 4, 160), (8, 1, 300), (8, 4, 300)]:
    cache = torch.randn(8, 3, 2056, 64)  # (slots, kv heads, capacity, head dim)
    k = v = cache[:rows, :, :keys]
    q = torch.randn(rows, 9, width, 64)
    mask = torch.ones(rows, 1, width, keys, dtype=torch.bool)
    torch.testing.assert_close(copied(q, k, v, mask), grouped(q, k, v, mask))
    times = [micros(lambda f=f, m=m, args=(q, k, v): f(*args, m))
             for f, m in ((copied, mask), (grouped, mask), (grouped, None))]
    print(f"| {rows} | {width} | {keys} | " + " | ".join(f"{t:.0f}" for t in times) + " |")
