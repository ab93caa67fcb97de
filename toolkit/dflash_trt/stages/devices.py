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
