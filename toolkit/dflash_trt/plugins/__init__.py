"""Finds and imports the speculative-decoding plugins that live outside the Python package.

The DFlash ops live in `plugins/dflash/` (reference, Triton kernels, tolerances), a link to the
package data `dflash_trt/data/plugins/dflash`, so a wheel ships them and a checkout edits them
in place. Either way they are imported once, under a fixed module
name, because importing them registers `torch.ops.dflash.*` and torch.library refuses a second
registration.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from dflash_trt.errors import DflashTrtError

DFLASH_MODULE = "dflash_trt_plugin_dflash"


def dflash_plugin_dir() -> Path:
    """The plugins/dflash folder (package data; the checkout's plugins/dflash links to it)."""
    candidate = Path(__file__).resolve().parent / "data" / "plugins" / "dflash"
    if (candidate / "__init__.py").is_file():
        return candidate
    raise DflashTrtError(
        "the DFlash plugin (plugins/dflash) is missing from this installation; reinstall "
        "dflash-trt, or run from a checkout that has plugins/dflash/"
    )


def load_dflash_ops() -> ModuleType:
    """Import plugins/dflash once and return it.

    The module has `kv_inject`, `block_draft_attention` and `accept` (Triton kernels on CUDA,
    the torch reference elsewhere), `reference`, `set_backend` and `load_tolerances`.
    """
    loaded = sys.modules.get(DFLASH_MODULE)
    if loaded is not None:
        return loaded
    plugin_dir = dflash_plugin_dir()
    spec = importlib.util.spec_from_file_location(
        DFLASH_MODULE, plugin_dir / "__init__.py", submodule_search_locations=[str(plugin_dir)]
    )
    if spec is None or spec.loader is None:
        raise DflashTrtError(f"cannot import the DFlash plugin from {plugin_dir}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[DFLASH_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[DFLASH_MODULE]
        raise
    return module
