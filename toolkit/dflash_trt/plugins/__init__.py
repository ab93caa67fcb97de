"""The speculative-decoding plugins: torch ops with their golden reference and tolerances.

The DFlash ops (KV injection, block-draft attention, acceptance) are written in the checkout's
top-level `plugins/dflash/`; pyproject.toml maps that folder to the package
`dflash_trt.plugins.dflash` (setuptools `package-dir`), so a wheel ships it and an editable install
imports the checkout's files in place. Import it through `load_dflash_ops()`, on first use only:
importing it needs torch and registers `torch.ops.dflash.*`.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

from dflash_trt.errors import DflashTrtError

DFLASH_MODULE = "dflash_trt.plugins.dflash"
# A bare checkout on sys.path (PYTHONPATH=toolkit, nothing installed; tests/gpu/run_gpu_checks.py)
# finds the top-level plugin folders too. Installed or editable, the package-dir mapping does.
_CHECKOUT = Path(__file__).resolve().parents[3]
_CHECKOUT_PLUGINS = _CHECKOUT / "plugins"
if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT_PLUGINS / "dflash").is_dir():
    __path__.append(str(_CHECKOUT_PLUGINS))
_MISSING = ("the DFlash plugin (plugins/dflash) is missing from this installation; reinstall "
            "dflash-trt (pip install -e . in a checkout)")


def dflash_plugin_dir() -> Path:
    """The folder the DFlash plugin is imported from (plugins/dflash in an editable install)."""
    spec = importlib.util.find_spec(DFLASH_MODULE)
    if spec is None or spec.origin is None:
        raise DflashTrtError(_MISSING)
    return Path(spec.origin).resolve().parent


def load_dflash_ops() -> ModuleType:
    """The DFlash plugin module: `kv_inject`, `block_draft_attention` and `accept` (Triton kernels
    on CUDA, the torch reference elsewhere), `reference`, `set_backend` and `load_tolerances`."""
    try:
        return importlib.import_module(DFLASH_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != DFLASH_MODULE:
            raise
        raise DflashTrtError(_MISSING) from None
