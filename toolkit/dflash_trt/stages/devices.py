"""Where build stages compute: the recipe's device when this machine has it, else the CPU."""

from __future__ import annotations


def resolve_device(device: str, hardware: str) -> str:
    """engine.device `auto` means cuda on GPU hardware, cpu on `cpu`."""
    if device != "auto":
        return device
    return "cpu" if hardware == "cpu" else "cuda"


def build_device(device: str, hardware: str) -> str:
    """Where build stages (quantize, verify, the smoke test) compute: the recipe's device when
    this machine has it, else the CPU. A GPU recipe may be built without a GPU; the artifacts are
    the same either way."""
    import warnings

    import torch

    want = resolve_device(device, hardware)
    if want == "cpu" or torch.cuda.is_available():
        return want
    if device.startswith("cuda"):  # asked for by name, not by `auto`: say where it runs instead
        warnings.warn(f"engine.device {device!r} but CUDA is not available here; build stages "
                      "run on the CPU (same artifacts, much slower for large models)", stacklevel=2)
    return "cpu"


def torch_device(recipe):
    """The torch device the quantize and verify stages compute on (see build_device)."""
    import torch

    return torch.device(build_device(recipe.engine.device, recipe.hardware))


# CPU flags with bfloat16 dot-product instructions; without them a bf16 matmul over more than one
# row is emulated and slower than float32 (an 8-token forward of SmolLM2-135M on an AVX2-only
# EPYC: 394 ms in bf16, 203 ms in fp32; docs/benchmarks.md).
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 flags; Arm's "Features" say bf16


def cpu_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """The BF16_CPU_FLAGS this CPU reports (Linux /proc/cpuinfo; none known elsewhere)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return []
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            flags.update(line.partition(":")[2].split())
    return [f for f in BF16_CPU_FLAGS if f in flags]


def engine_dtype(recipe) -> str:
    """The compute dtype the engine serves in: engine.dtype, where `auto` means bfloat16 on a
    CPU with native bf16 instructions and float32 on one without (or when the torch engine
    batches); on a GPU the target's dtype.
    Unset means the target's dtype. `auto` is decided on the machine that builds (compile writes
    it into engine.yaml): build where you serve, as the CPU default does."""
    dtype = recipe.engine.dtype
    if dtype is None:
        return recipe.target.dtype
    if dtype != "auto":
        return dtype
    if resolve_device(recipe.engine.device, recipe.hardware) != "cpu":
        return recipe.target.dtype
    if recipe.engine.backend == "torch" and recipe.engine.max_batch_size > 1:
        return "float32"  # bf16's row-wise attention serves batch 1 (dflash/attention.py)
    return "bfloat16" if cpu_bf16_flags() else "float32"


# Working room on top of the weights while a stage computes (activations, calibration batches,
# the drafter, the allocator's slack): the weights may take at most this share of the GPU.
ONE_GPU_WEIGHT_SHARE = 0.8


def check_fits_one_gpu(checkpoint_bytes: int, device, stage: str, gpu_bytes: int | None = None):
    """Quantize and verify place the target on one device: refuse, with the numbers, a target
    whose weights would not fit the GPU (rather than fail with an out-of-memory error later).
    `checkpoint_bytes` are the weights as the stage loads them; CPU stages are not checked."""
    from dflash_trt.errors import DflashTrtError

    if getattr(device, "type", device) != "cuda":
        return
    if gpu_bytes is None:
        import torch

        gpu_bytes = torch.cuda.get_device_properties(device).total_memory
    if checkpoint_bytes > ONE_GPU_WEIGHT_SHARE * gpu_bytes:
        gib = 2**30
        raise DflashTrtError(
            f"{stage}: the target's weights ({checkpoint_bytes / gib:.1f} GiB as loaded) do not "
            f"fit one GPU ({gpu_bytes / gib:.1f} GiB, {ONE_GPU_WEIGHT_SHARE:.0%} usable for "
            f"weights); this stage places the target on one GPU (no multi-GPU placement yet): "
            "run it on a GPU with more memory, or with engine.device: cpu (slow, same artifacts)")


def loaded_bytes(checkpoint_dir, dtype) -> int:
    """Bytes of a checkpoint's weights once loaded in `dtype`: its parameter count (from the
    safetensors headers, no tensor read) x the dtype's size."""
    import json
    import struct
    from pathlib import Path

    import torch

    count = 0
    for path in Path(checkpoint_dir).glob("*.safetensors"):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for d in entry["shape"]:
                    n *= d
                count += n
    return count * torch.empty((), dtype=dtype).element_size()
