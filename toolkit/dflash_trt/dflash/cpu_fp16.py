"""NVFP4 weights read as 16-bit floats on CPU: half the bytes a decoding step streams.

On a CPU a decoding step's linear layers stream every weight once whatever the row count, and the
torch engine dequantizes NVFP4 weights to float32 at load: 4 bytes per weight. An NVFP4 weight is
an E2M1 value times its block's E4M3 scale times the tensor's float32 `weight_scale_2` (g). The
first product has at most 6 significant bits and lies in [2^-10, 2688], so it is exact in float16:
W = W16 * g with nothing rounded, and `cpu_fp16.cpp` computes x @ W16.T * g from 2 bytes per
weight. Against the float32 path only the order of the float32 sums differs (as between any two
matmul kernels); against float64 it is within the bound of one float32 sum of exact products
(tests/unit/dflash/test_cpu_fp16.py).

The kernel is register-blocked (outer products, as GEMM kernels are): a weight it converts serves
a tile of up to 6 rows x 16 outputs held in registers, so calls of many rows (a wide verify
forward, a batch) convert each weight once per 6 rows: at 32 rows it took 0.56x the seconds of
the kernel before it (dot products, tiles of 4 rows x 2 outputs) on one machine and 0.75x on
another, and beat oneDNN on both (docs/benchmarks.md, session 21). Each row's
result is the same whichever rows share the call (the kernel's sum order does not depend on
them), so up to `max_rows()` rows a batched step computes each row's linear layers exactly as a
batch of one would. Beyond that (long prompt chunks) oneDNN's packed float32 kernel runs.

On a CPU with AVX-512F a second kernel runs: the same operations in the same order per (row,
output), so the same bits, with a panel's 16 outputs in one register and, from 6 rows on, two
panels per tile of up to 8 rows (16 sums in registers, each broadcast of an input serving 32
outputs). On a CPU with AMX (AMX-TILE, AMX-BF16; Sapphire Rapids and later Xeons) a third one
runs tile matrix multiplies: W16 is exact in bfloat16 as well, x goes in as three bfloat16 parts
that sum to it exactly, so every product is still exact and y a float32 sum of them (3 per
weight; other bits than the AVX kernels', the same bound against float64, and a row's result
again independent of the other rows); it runs where DFLASH_TRT_CPU_FP16=amx asks for it
(DEFAULT_OFF). DFLASH_TRT_CPU_FP16=avx2 keeps the AVX2 kernel (to compare them).

The kernels are compiled on first use with the system's C++ compiler ($CXX, else g++) into
$DFLASH_TRT_KERNEL_CACHE (default $XDG_CACHE_HOME or ~/.cache, then dflash-trt/kernels), and run on the OpenMP runtime
torch already loaded, with torch's thread count. They need an x86-64 CPU with AVX2, FMA and F16C.
Without one, without a compiler, or with DFLASH_TRT_CPU_FP16=0, `load()` says why once (stderr)
and returns None, and the layers stay on oneDNN.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

# Up to this many rows each kernel beats oneDNN's packed float32 one on the 2-core EPYCs this
# project measured on (scripts/cpu_linear_bench.py, docs/benchmarks.md): AVX2 1137 against 1661 us
# at 32 rows on a Zen 1, 320 against 339 on a Zen 4, about even at 64 (session 21); AVX-512 245
# against 269 us at 64 rows and 454 against 468 at 128 on a Zen 5 (session 27); AMX 366 against
# 802 at 128 rows and 1397 against 2712 at 512 on a 2-core Xeon with AMX (session 28), so every
# prompt chunk (batch.PREFILL_CHUNK, 512) runs on it.
MAX_ROWS = {"avx2": 32, "avx512": 128, "amx": 512}
# Kernels `load()` picks only when DFLASH_TRT_CPU_FP16 names them: AMX is 2x the AVX-512 kernel
# from 12 rows on but 10% slower at 1 row, and end to end it was level with it (docs/benchmarks.md,
# session 28), so it is not yet the default where both run.
DEFAULT_OFF = ("amx",)
NAMES = {"avx2": "fp16_linear", "avx512": "fp16_linear_avx512", "amx": "bf16_linear_amx"}
PANEL = 16  # outputs per weight panel (cpu_fp16.cpp)
SOURCE = Path(__file__).with_name("cpu_fp16.cpp")
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC"]
_kernel: ctypes._CFuncPtr | None | bool = False  # False: not tried yet


def load() -> ctypes._CFuncPtr | None:
    """The compiled kernel for this CPU (`fp16_linear_avx512` where it has AVX-512F, else
    `fp16_linear`; DFLASH_TRT_CPU_FP16=avx2, avx512 or amx asks for one), or None (with one line
    on stderr saying why) where it cannot run."""
    global _kernel
    if _kernel is False:
        lib, why = _build()
        if why:
            print(f"dflash-trt: float16 CPU kernel off ({why}); linear layers use oneDNN",
                  file=sys.stderr)
        _kernel = None if lib is None else _pick(lib)
    return _kernel


def _pick(lib: ctypes.CDLL) -> ctypes._CFuncPtr:
    choices = kernels(lib)
    wanted = os.environ.get("DFLASH_TRT_CPU_FP16", "1")
    if wanted in choices:
        return choices[wanted]
    return next(choices[k] for k in ("avx512", "avx2") if k in choices and k not in DEFAULT_OFF)


def isa() -> str | None:
    """Which kernel `load()` picked ("avx2", "avx512" or "amx"), None where none runs."""
    kernel = load()
    return None if kernel is None else next(k for k, n in NAMES.items() if n == kernel.__name__)


def max_rows() -> int:
    """The most rows a call sends to the loaded kernel (MAX_ROWS), 0 where none runs."""
    kernel = isa()
    return 0 if kernel is None else MAX_ROWS[kernel]


def kernels(lib: ctypes.CDLL | None = None) -> dict[str, ctypes._CFuncPtr]:
    """Every kernel this CPU can run ("avx2"; "avx512" with AVX-512F; "amx" with AMX-BF16 and
    the tile state Linux granted), not only the one `load()` picks; empty where none can
    (scripts/cpu_linear_bench.py times them side by side)."""
    if lib is None:
        if load() is None:
            return {}
        lib, _ = _build()
    names = {"avx2": NAMES["avx2"]}
    if _cpu_has("avx512f"):
        names["avx512"] = NAMES["avx512"]
    if _amx(lib):
        names["amx"] = NAMES["amx"]
    found = {}
    for isa, name in names.items():
        kernel = getattr(lib, name)
        kernel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p,
                           ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        kernel.restype = ctypes.c_int if isa == "amx" else None  # AMX: 0, or -1 (no scratch)
        found[isa] = kernel
    return found


def _amx(lib: ctypes.CDLL) -> bool:
    """This CPU has AMX-BF16 (and AVX-512BW), the library has its kernel, and Linux grants the
    process the tile state (asked once; the grant is the process's)."""
    if not (_cpu_has("amx_tile", "amx_bf16", "avx512f", "avx512bw")
            and hasattr(lib, "amx_enable")):
        return False
    return lib.amx_enable() == 0


def _build() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("DFLASH_TRT_CPU_FP16", "1") == "0":
        return None, ""
    if platform.machine() not in ("x86_64", "AMD64") or not _cpu_has("avx2", "fma", "f16c"):
        return None, "this CPU lacks AVX2, FMA or F16C"
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    cache = _cache_dir()
    lib_path = cache / f"cpu_fp16-{digest}.so"
    if not lib_path.exists():
        compiler = os.environ.get("CXX", "g++")
        try:
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:  # compile aside, then rename
                out = Path(tmp) / lib_path.name
                subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(out)], check=True,
                               capture_output=True, timeout=300)
                os.replace(out, lib_path)
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"cannot compile {SOURCE.name} with {compiler}: {exc}"
    try:
        return ctypes.CDLL(str(lib_path)), ""
    except OSError as exc:
        return None, f"cannot load {lib_path}: {exc}"


def _cache_dir() -> Path:
    if os.environ.get("DFLASH_TRT_KERNEL_CACHE"):
        return Path(os.environ["DFLASH_TRT_KERNEL_CACHE"])
    try:
        root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except RuntimeError:  # no home directory (a service account)
        root = Path(tempfile.gettempdir())
    return root / "dflash-trt" / "kernels"


def _cpu_has(*flags: str) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(flags) <= set(line.split())


def fits(out_features: int, in_features: int) -> bool:
    """The kernels' shapes: outputs in multiples of 16 (any number of inputs)."""
    return out_features % PANEL == 0 and in_features > 0


def blocked(unscaled: torch.Tensor, kernel: str | None = None) -> torch.Tensor:
    """An NVFP4 weight before its weight_scale_2 (formats.qformats.NVFP4Weight.unscaled, [out,
    in]) -> the layout of `kernel` (default: the one `load()` picks), exact, or ValueError.
    AVX2 and AVX-512: float16 panels of 16 outputs [out/16, in, 16]. AMX: bfloat16 pairs
    [out/16, in'/2, 16, 2] with the inputs padded by zero weights to in', a multiple of 32."""
    out, inp = unscaled.shape
    amx = (kernel or isa()) == "amx"
    half = unscaled.to(torch.bfloat16 if amx else torch.float16)
    if not torch.equal(half.to(unscaled.dtype), unscaled):
        raise ValueError(f"the weight is not exact in {half.dtype}; it is not an NVFP4 weight")
    if not amx:
        return half.reshape(out // PANEL, PANEL, inp).transpose(1, 2).contiguous()
    padded = torch.nn.functional.pad(half, (0, -inp % 32))
    return padded.reshape(out // PANEL, PANEL, -1, 2).transpose(1, 2).contiguous() \
        .view(torch.int16)


def unblocked(w: torch.Tensor) -> torch.Tensor:
    """`blocked`'s result back to the weight [out, in'] (in' = in padded, for AMX), float32."""
    if w.dim() == 3:  # float16 panels [out/16, in, 16]
        return w.transpose(1, 2).reshape(w.shape[0] * PANEL, -1).float()
    half = w.view(torch.bfloat16)  # [out/16, in'/2, 16, 2]
    return half.transpose(1, 2).reshape(w.shape[0] * PANEL, -1).float()


def linear(x: torch.Tensor, w: torch.Tensor, g: float) -> torch.Tensor:
    """x (rows, in) float32 @ W.T * g with W from `blocked` for the loaded kernel; rows <=
    max_rows() is the fast case, any row count is correct."""
    kernel = load()
    if kernel is None:
        raise RuntimeError("the CPU weight kernel is not available here")
    if w.dim() != (4 if isa() == "amx" else 3):  # another kernel's layout would read past it
        raise ValueError(f"a weight blocked for another kernel (shape {tuple(w.shape)}) than the "
                         f"loaded {isa()} one; block it with cpu_fp16.blocked(w) after load()")
    x = x.contiguous()
    rows, inp = x.shape
    out = w.shape[0] * PANEL
    y = torch.empty(rows, out, dtype=torch.float32)
    if kernel(x.data_ptr(), w.data_ptr(), g, y.data_ptr(), rows, inp, out,
              torch.get_num_threads()):
        raise MemoryError(f"the {isa()} kernel could not allocate its scratch for {rows} rows "
                          f"x {inp} inputs")
    return y
