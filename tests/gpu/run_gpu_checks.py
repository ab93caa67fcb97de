"""All GPU checks of the DFlash plugin in one run: kernel vs reference at Qwen3-8B drafter sizes
(hidden 4096, 32 q heads, 8 kv heads, head_dim 128, 5 layers, block 16, context 4k) and a
micro-benchmark of the plugin's part of drafting one block, reference vs Triton kernels.

    python tests/gpu/run_gpu_checks.py --out gpu_checks.json

Writes a JSON summary ({"device", "versions", "checks": [...], "benchmarks": [...], "ok"}) and
exits 1 if any check is outside plugins/dflash/tolerances.yaml. Needs CUDA and triton-lang.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "toolkit"))
from dflash_trt.plugins import load_dflash_ops  # noqa: E402

ops = load_dflash_ops()
cases = importlib.import_module(f"{ops.__name__}.cases")
kernels = importlib.import_module(f"{ops.__name__}.kernels")
ref = ops.reference
SHAPE = cases.QWEN3_8B
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def correctness_checks() -> list[dict]:
    """Kernel vs reference on every op, dtype and production shape."""
    results = []
    for dtype in DTYPES:
        for num_tokens in (16, 4096):  # a decode step's accepted tokens; a 4k prefill
            args = cases.kv_inject_inputs(SHAPE, num_tokens, 4096 - num_tokens, dtype, "cuda")
            c = cases.compare("kv_inject", kernels.kv_inject(*args), ref.kv_inject(*args))
            results.append({**asdict(c), "case": f"T={num_tokens}"})
        for num_ctx, window in ((4096, 0), (4096, 2048), (4095, 0), (1, 0)):
            args = cases.attention_inputs(SHAPE, num_ctx, dtype, "cuda")
            got = kernels.block_draft_attention(*args, window)
            c = cases.compare("block_draft_attention", got, ref.block_draft_attention(*args, window))
            results.append({**asdict(c), "case": f"ctx={num_ctx} window={window}"})
        tokens, p, q, u = cases.accept_inputs(8, SHAPE.block_size - 1, SHAPE.vocab, dtype, "cuda")
        for name, args in (("greedy", (tokens, p)), ("sampling", (tokens, p, q, u))):
            got, want = kernels.accept(*args), ref.accept(*args)
            same = all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            results.append({"op": "accept", "dtype": str(dtype).removeprefix("torch."),
                            "case": f"{name} N=8 g={SHAPE.block_size - 1} V={SHAPE.vocab}", "ok": same,
                            "num_accepted": want[0].tolist()})
    return results


def _median_ms(fn, iters: int = 50, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _draft_step_parts(dtype: torch.dtype, num_ctx: int) -> dict:
    """name -> fn(impl) for one dtype; impl is the reference or the kernels module."""
    inject = cases.kv_inject_inputs(SHAPE, SHAPE.block_size, num_ctx, dtype, "cuda")
    prefill = cases.kv_inject_inputs(SHAPE, num_ctx, 0, dtype, "cuda")
    attn = cases.attention_inputs(SHAPE, num_ctx, dtype, "cuda")
    tokens, p, _, _ = cases.accept_inputs(1, SHAPE.block_size - 1, SHAPE.vocab, dtype, "cuda")

    def step(impl):
        impl.kv_inject(*inject)
        for _ in range(SHAPE.num_layers):
            impl.block_draft_attention(*attn, 0)
        impl.accept(tokens, p)

    return {
        "kv_inject_T16": lambda impl: impl.kv_inject(*inject),
        f"kv_inject_T{num_ctx}": lambda impl: impl.kv_inject(*prefill),
        f"attention_ctx{num_ctx}": lambda impl: impl.block_draft_attention(*attn, 0),
        "accept_greedy": lambda impl: impl.accept(tokens, p),
        "draft_block_total": step,
    }


def benchmarks(num_ctx: int = 4096) -> list[dict]:
    """The plugin's share of one draft step: inject 16 accepted tokens, attend from a 16-token
    block in each of the 5 layers over a 4k context, accept greedily against 16 target rows.
    (The drafter's own q/k/v/o and MLP GEMMs are the same in both paths and not included.)"""
    results = []
    for dtype in (torch.bfloat16, torch.float16):
        for name, fn in _draft_step_parts(dtype, num_ctx).items():
            ref_ms = _median_ms(lambda fn=fn: fn(ref))
            ker_ms = _median_ms(lambda fn=fn: fn(kernels))
            results.append({"bench": name, "dtype": str(dtype).removeprefix("torch."),
                            "reference_ms": round(ref_ms, 4), "kernels_ms": round(ker_ms, 4),
                            "speedup": round(ref_ms / ker_ms, 2)})
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_checks.json"))
    parser.add_argument("--skip-bench", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("run_gpu_checks: no CUDA device; nothing to check", file=sys.stderr)
        return 2
    import triton

    torch.manual_seed(0)
    checks = correctness_checks()
    summary = {
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": triton.__version__,
                     "cuda": torch.version.cuda},
        "shape": asdict(SHAPE),
        "checks": checks,
        "benchmarks": [] if args.skip_bench else benchmarks(),
        "ok": all(c["ok"] for c in checks),
    }
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    for c in checks:
        print(f"{'ok  ' if c['ok'] else 'FAIL'} {c['op']:<22} {c['dtype']:<9} {c['case']:<28} "
              f"max_abs_err={c.get('max_abs_err', 0):.3g}")
    for b in summary["benchmarks"]:
        print(f"bench {b['bench']:<20} {b['dtype']:<9} reference {b['reference_ms']:8.3f} ms  "
              f"kernels {b['kernels_ms']:8.3f} ms  x{b['speedup']}")
    print(f"wrote {args.out}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
