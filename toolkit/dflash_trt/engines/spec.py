"""`engine.yaml`: what the compile stage writes and every engine loader reads.

Checkpoint paths are relative to the file, so an engine directory can be copied into a Triton
model repository (or onto another machine) and still load.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal

import yaml

from dflash_trt.errors import DflashTrtError

ENGINE_FILE = "engine.yaml"
Backend = Literal["torch", "tensorrt_llm"]


def inside_engine_tree(engine_dir: Path, rel: str | Path, what: str) -> Path:
    """`rel`, relative to the engine directory, as an absolute path; refuses a path (absolute, or
    with ..) that leaves the directory holding the engine (the build, or the model version
    directory of a Triton repository). `what` names the file and field for the error."""
    engine_dir = Path(engine_dir).resolve()
    path = (engine_dir / rel).resolve()
    if not path.is_relative_to(engine_dir.parent):
        raise DflashTrtError(f"{engine_dir}/{what} path {str(rel)!r} points outside "
                             f"{engine_dir.parent}; engine directories must be self-contained "
                             "(rebuild with --force compile)")
    return path


@dataclass(frozen=True)
class SamplingDefaults:
    """Request defaults the Triton model applies when an input is absent."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


@dataclass(frozen=True)
class EngineSpec:
    """The contents of engine.yaml."""

    backend: Backend
    target: str  # checkpoint directory, relative to engine.yaml
    drafter: str | None  # None: no drafter (plain decoding)
    dtype: str
    device: str  # "cpu" or "cuda"
    block_size: int
    max_batch_size: int
    max_seq_len: int
    chat_template: bool  # wrap text_input in the tokenizer's chat template
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    prompt_lookup: bool = False  # torch engine: n-gram drafts before the drafter
    parse_special_tokens: bool = False  # control tokens in text_input stay text unless set
    draft_length: str = "fixed"  # torch engine: "adaptive" verifies only drafts worth their cost
    max_queue: int = 64  # torch engine, batching: requests that may wait for a batch row
    queue_timeout_s: float = 60.0  # torch engine, batching: longest wait for a row, then an error
    prefix_cache_tokens: int = 0  # torch engine, batching: prompt tokens kept for reuse

    def write(self, engine_dir: Path) -> Path:
        """Write engine_dir/engine.yaml; return its path."""
        path = Path(engine_dir) / ENGINE_FILE
        header = "# Written by `dflash-trt build` (compile stage). Paths are relative to this file.\n"
        path.write_text(header + yaml.safe_dump(asdict(self), sort_keys=False))
        return path

    @classmethod
    def read(cls, engine_dir: Path) -> EngineSpec:
        """Read and check engine_dir/engine.yaml."""
        path = Path(engine_dir) / ENGINE_FILE
        if not path.is_file():
            raise DflashTrtError(f"{path} is missing; build the engine with "
                                 "`dflash-trt build RECIPE` (compile stage)")
        data = yaml.safe_load(path.read_text())
        if not isinstance(data, dict):
            raise DflashTrtError(f"{path}: expected a mapping")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        missing = sorted(f.name for f in fields(cls) if f.name not in data
                         and f.default is MISSING and f.default_factory is MISSING)
        if unknown or missing:
            raise DflashTrtError(f"{path}: unknown keys {unknown}, missing keys {missing}; "
                                 "rebuild with `dflash-trt build RECIPE --force compile`")
        if data["backend"] not in ("torch", "tensorrt_llm"):
            raise DflashTrtError(f"{path}: backend {data['backend']!r} is not torch or "
                                 "tensorrt_llm")
        try:
            defaults = SamplingDefaults(**(data.pop("defaults", None) or {}))
        except TypeError as exc:
            raise DflashTrtError(f"{path}: bad `defaults`: {exc}") from None
        return cls(**data, defaults=defaults)

    def checkpoint(self, engine_dir: Path, which: Literal["target", "drafter"]) -> Path | None:
        """Absolute path of a checkpoint; refuses paths that leave the engine's parent tree."""
        rel = getattr(self, which)
        if rel is None:
            return None
        engine_dir = Path(engine_dir).resolve()
        path = inside_engine_tree(engine_dir, rel, f"{ENGINE_FILE}: {which}")
        if not path.is_dir():
            raise DflashTrtError(f"{engine_dir / ENGINE_FILE}: {which} checkpoint {path} is "
                                 "missing; rebuild with `dflash-trt build RECIPE --force compile`")
        return path
