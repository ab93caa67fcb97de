"""A checkpoint directory copied with its floating-point tensors in another dtype."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from dflash_trt.errors import DflashTrtError


def cast_checkpoint(src: Path, dst: Path, dtype: str) -> str:
    """Write `src` to `dst` with every floating safetensors tensor in `dtype` and config.json's
    dtype set to it; other files are copied. Returns "cast to DTYPE" or "copy" (already DTYPE)."""
    from safetensors.torch import load_file, save_file

    from dflash_trt.formats.load import torch_dtype

    want = torch_dtype(dtype)
    files = sorted(Path(src).glob("*.safetensors"))
    if not files:
        raise DflashTrtError(f"{src}: no *.safetensors weights to cast to {dtype}")
    dst = Path(dst)
    dst.mkdir(parents=True)
    changed = False
    for path in Path(src).iterdir():
        if path.suffix == ".safetensors":
            tensors = load_file(path)
            changed |= any(t.is_floating_point() and t.dtype != want for t in tensors.values())
            save_file({k: t.to(want) if t.is_floating_point() else t for k, t in tensors.items()},
                      dst / path.name, metadata={"format": "pt"})
        elif path.is_file():
            shutil.copyfile(path, dst / path.name)
    config_path = dst / "config.json"
    if config_path.is_file():
        config = json.loads(config_path.read_text())
        for key in ("dtype", "torch_dtype"):
            if key in config:
                changed |= config[key] != dtype
                config[key] = dtype
        config.setdefault("dtype", dtype)
        config_path.write_text(json.dumps(config, indent=2) + "\n")
    return f"cast to {dtype}" if changed else "copy"
