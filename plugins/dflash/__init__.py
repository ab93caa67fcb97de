"""DFlash speculative plugin: KV injection, block-draft attention and acceptance as torch ops.

This folder is the package `dflash_trt.plugins.dflash` (pyproject.toml maps it with setuptools
`package-dir`; the wheel ships it). Import it through `dflash_trt.plugins.load_dflash_ops()`:
importing it registers the ops with torch.library.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from . import reference
from .ops import (
    BACKENDS,
    accept,
    block_draft_attention,
    get_backend,
    kv_inject,
    set_backend,
    triton_available,
)

PLUGIN_DIR = Path(__file__).resolve().parent

__all__ = [
    "BACKENDS",
    "PLUGIN_DIR",
    "accept",
    "block_draft_attention",
    "get_backend",
    "kv_inject",
    "load_tolerances",
    "reference",
    "set_backend",
    "triton_available",
]


def load_tolerances() -> dict[str, dict[str, dict[str, float]]]:
    """tolerances.yaml as {op: {dtype name: {"abs_tol": a, "rel_tol": r}}}."""
    with open(PLUGIN_DIR / "tolerances.yaml", encoding="utf-8") as handle:
        return yaml.safe_load(handle)
