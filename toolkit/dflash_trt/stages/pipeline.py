"""The build pipeline: ordered stages, input hashing, a manifest, atomic outputs.

Each stage reads its recipe section(s) and upstream stage outputs and writes one directory under
build/<name>/. A stage writes into a temporary directory that is renamed into place only when it
succeeds, so an interrupted or failed stage leaves the previous good output (or nothing). A stage
is skipped when its input hash (recipe sections, upstream outputs, local input files, tool
versions) matches the manifest and its recorded outputs are intact.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.metadata
import json
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from dflash_trt import __version__
from dflash_trt.atomic import install_dir, temp_dir_for, write_atomic
from dflash_trt.errors import DflashTrtError, NotImplementedStage, UsageError
from dflash_trt.recipe import Recipe

MANIFEST = "manifest.json"


@dataclass(frozen=True)
class StageSpec:
    """A pipeline stage: what it reads, where it writes, which function does the work."""

    name: str
    output: str  # directory name under build/<name>/
    sections: tuple[str, ...]  # recipe sections (or "section.field") that feed its input hash
    depends: tuple[str, ...]  # upstream stages whose outputs it reads
    impl: str | Callable[[StageContext], dict | None]  # "module:function" or a callable
    tools: tuple[str, ...] = ()  # distributions whose versions feed the input hash


STAGES: tuple[StageSpec, ...] = (
    StageSpec("resolve", "resolved", ("target", "drafter"), (),
              "dflash_trt.stages.resolve:run_resolve_stage", ("torch", "transformers", "gguf")),
    StageSpec("quantize", "quantized", ("quantize",), ("resolve",),
              "dflash_trt.stages.quantize:run_quantize_stage",
              ("torch", "transformers", "nvidia-modelopt")),
    # verify also reads how the engine will serve: the dtype and device it checks in, and the
    # backend (tensorrt_llm gates on full-vocabulary acceptance)
    StageSpec("verify", "reports", ("verify", "target", "hardware", "engine.backend",
                                    "engine.device", "engine.dtype", "engine.max_seq_len"),
              ("quantize",),
              "dflash_trt.stages.verify:run_verify_stage", ("torch", "transformers")),
    # compile reads the verify report: the acceptance profile (calibration, draft_len_schedule)
    StageSpec("compile", "engine", ("engine", "hardware", "drafter", "triton"),
              ("quantize", "verify"),
              "dflash_trt.stages.compile:run_compile_stage", ("torch", "transformers")),
    StageSpec("emit", "triton_repo", ("triton", "hardware"), ("compile",),
              "dflash_trt.stages.emit:run_emit_stage", ("tritonclient",)),
)


# --- progress -------------------------------------------------------------------------------


class ProgressTask:
    """One progress line; `advance()` it, use it as a context manager."""

    def __init__(self, progress: Any, description: str, total: int | None):
        self._progress = progress
        self._id = progress.add_task(description, total=total) if progress else None

    def advance(self, n: int = 1) -> None:
        if self._progress is not None:
            self._progress.advance(self._id, n)

    def __enter__(self) -> ProgressTask:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.remove_task(self._id)


@dataclass(frozen=True)
class StageContext:
    """What a stage implementation gets: its recipe, where to write, where its inputs are."""

    recipe: Recipe
    build_dir: Path
    out: Path  # empty temporary directory; renamed into place on success
    rich_progress: Any = None  # a rich.progress.Progress, or None when quiet
    stages: tuple[StageSpec, ...] = STAGES

    def stage_dir(self, name: str) -> Path:
        """Final output directory of an (upstream) stage."""
        return self.build_dir / stage_by_name(name, self.stages).output

    def progress(self, description: str, total: int | None = None) -> ProgressTask:
        return ProgressTask(self.rich_progress, description, total)


def stage_by_name(name: str, stages: Sequence[StageSpec] = STAGES) -> StageSpec:
    for spec in stages:
        if spec.name == name:
            return spec
    raise UsageError(f"unknown stage {name!r}; stages are: {', '.join(s.name for s in stages)}")


# --- hashing --------------------------------------------------------------------------------


def _sha(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def fingerprint_tree(root: Path) -> dict[str, list[int]]:
    """{relative path: [size, mtime_ns]} for every file under root (a file root maps to '.').

    Python bytecode caches are left out: serving a repository writes them next to model.py.
    """
    if root.is_file():
        st = root.stat()
        return {".": [st.st_size, st.st_mtime_ns]}
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.relative_to(root).parts:
            st = path.stat()
            out[str(path.relative_to(root))] = [st.st_size, st.st_mtime_ns]
    return out


def _local_paths(value: Any) -> Iterator[Path]:
    """Absolute existing paths inside a dumped recipe section (local sources, data files)."""
    if isinstance(value, dict):
        for v in value.values():
            yield from _local_paths(v)
    elif isinstance(value, list):
        for v in value:
            yield from _local_paths(v)
    elif isinstance(value, str) and value.startswith("/") and Path(value).exists():
        yield Path(value)


def _tool_versions(tools: Sequence[str]) -> dict[str, str | None]:
    versions: dict[str, str | None] = {"dflash-trt": __version__}
    for dist in tools:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return versions


def _field(dump: dict, name: str):
    """dump["a"]["b"] for "a.b"."""
    for key in name.split("."):
        dump = dump[key]
    return dump


def input_hashes(spec: StageSpec, recipe: Recipe, manifest: dict) -> dict[str, str]:
    """The parts of a stage's input hash, kept apart so `plan` can say which one changed."""
    dump = recipe.model_dump(mode="json")
    sections = {s: _field(dump, s) for s in spec.sections}
    files = {str(p): fingerprint_tree(p) for p in _local_paths(sections)}
    upstream = {d: manifest.get("stages", {}).get(d, {}).get("output_hash") for d in spec.depends}
    return {
        "recipe": _sha(sections),
        "files": _sha(files),
        "upstream": _sha(upstream),
        "tools": _sha(_tool_versions(spec.tools)),
    }


# --- manifest -------------------------------------------------------------------------------


def read_manifest(build_dir: Path) -> dict:
    path = build_dir / MANIFEST
    if not path.exists():
        return {"stages": {}}
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {"stages": {}}  # a damaged manifest only means every stage reruns


def _write_manifest(build_dir: Path, manifest: dict) -> None:
    write_atomic(build_dir / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def stale_reason(spec: StageSpec, recipe: Recipe, build_dir: Path, manifest: dict) -> str | None:
    """None when the stage is up to date, else why it must run."""
    entry = manifest.get("stages", {}).get(spec.name)
    if not entry:
        return "never run"
    if entry.get("status") != "ok":
        return f"last run {entry.get('status', 'unknown')}"
    old = entry.get("inputs", {})
    new = input_hashes(spec, recipe, manifest)
    changed = [k for k in ("recipe", "files", "upstream", "tools") if old.get(k) != new[k]]
    if changed:
        labels = {"recipe": f"recipe section(s) {', '.join(spec.sections)} changed",
                  "files": "local input files changed", "upstream": "upstream outputs changed",
                  "tools": "tool versions changed"}
        return "; ".join(labels[k] for k in changed)
    out = build_dir / spec.output
    if not out.is_dir() or fingerprint_tree(out) != entry.get("outputs"):
        return "outputs missing or modified"
    return None


# --- running --------------------------------------------------------------------------------


@dataclass
class StageResult:
    name: str
    status: str  # ok | skipped | failed | not_implemented | interrupted
    seconds: float = 0.0
    note: str = ""
    info: dict = field(default_factory=dict)


def _resolve_impl(spec: StageSpec) -> Callable[[StageContext], dict | None]:
    if callable(spec.impl):
        return spec.impl
    module_name, _, func_name = spec.impl.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise NotImplementedStage(f"stage {spec.name!r} is not implemented in this version "
                                      f"of dflash-trt ({module_name} is missing)") from None
        raise DflashTrtError(f"stage {spec.name!r} needs the Python package {exc.name!r}; "
                             "install the CPU stack with `make setup` "
                             "(or pip install 'dflash-trt[cpu]')") from None
    func = getattr(module, func_name, None)
    if func is None:
        raise NotImplementedStage(f"stage {spec.name!r} is not implemented in this version of "
                                  f"dflash-trt ({spec.impl} is missing)")
    return func


@contextlib.contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """One build per directory at a time."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".lock", "w") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DflashTrtError(f"another build is running in {build_dir}; wait for it "
                                 "or stop it") from None
        yield


def _clean_leftovers(build_dir: Path) -> None:
    """Remove temporary stage dirs that an interrupted earlier run left behind."""
    for path in build_dir.glob(".*.tmp-*"):
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    for path in build_dir.glob(".*.old-*"):
        shutil.rmtree(path, ignore_errors=True)


def select_stages(only: Sequence[str] = (), stages: Sequence[StageSpec] = STAGES) -> list[str]:
    for name in only:
        stage_by_name(name, stages)
    return [s.name for s in stages if not only or s.name in only]


def run_pipeline(
    recipe: Recipe,
    *,
    build_dir: Path | None = None,
    only: Sequence[str] = (),
    force: Sequence[str] = (),
    stages: Sequence[StageSpec] = STAGES,
    rich_progress: Any = None,
    on_result: Callable[[StageResult], None] | None = None,
) -> list[StageResult]:
    """Run the selected stages in order, skipping up-to-date ones; stop at the first failure.

    Raises the stage's error after recording it in the manifest; returns every result otherwise.
    """
    build_dir = Path(build_dir or recipe.build_dir)
    selected = select_stages(only, stages)
    for name in force:
        stage_by_name(name, stages)
    results: list[StageResult] = []
    with build_lock(build_dir):
        _clean_leftovers(build_dir)
        manifest = read_manifest(build_dir)
        manifest.update(recipe=recipe.name, dflash_trt_version=__version__)
        manifest.setdefault("stages", {})
        for spec in stages:
            if spec.name not in selected:
                continue
            for dep in spec.depends:
                dep_entry = manifest["stages"].get(dep, {})
                dep_dir = build_dir / stage_by_name(dep, stages).output
                if dep_entry.get("status") != "ok" or not dep_dir.is_dir():
                    raise UsageError(f"stage {spec.name!r} needs the output of {dep!r}, which "
                                     f"has not been built; run `dflash-trt build` without "
                                     f"--only, or add {dep} to --only")
            reason = stale_reason(spec, recipe, build_dir, manifest)
            if reason is None and spec.name not in force:
                result = StageResult(spec.name, "skipped", note="up to date")
                results.append(result)
                if on_result:
                    on_result(result)
                continue
            result = _run_stage(spec, recipe, build_dir, manifest, rich_progress, tuple(stages))
            results.append(result)
            if on_result:
                on_result(result)
    return results


def _run_stage(spec: StageSpec, recipe: Recipe, build_dir: Path, manifest: dict,
               rich_progress: Any, stages: tuple[StageSpec, ...]) -> StageResult:
    inputs = input_hashes(spec, recipe, manifest)
    entry: dict[str, Any] = {
        "inputs": inputs,
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    tmp = temp_dir_for(build_dir / spec.output)
    t0 = time.perf_counter()
    ctx = StageContext(recipe=recipe, build_dir=build_dir, out=tmp, rich_progress=rich_progress,
                       stages=stages)
    try:
        impl = _resolve_impl(spec)
        info = impl(ctx) or {}
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        status = ("not_implemented" if isinstance(exc, NotImplementedStage)
                  else "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")
        entry.update(status=status, seconds=round(time.perf_counter() - t0, 3),
                     error=str(getattr(exc, "message", exc)) or type(exc).__name__)
        manifest["stages"][spec.name] = entry
        _write_manifest(build_dir, manifest)
        raise
    final = build_dir / spec.output
    install_dir(tmp, final)
    outputs = fingerprint_tree(final)
    entry.update(status="ok", seconds=round(time.perf_counter() - t0, 3), info=info,
                 outputs=outputs, output_hash=_sha(outputs))
    manifest["stages"][spec.name] = entry
    _write_manifest(build_dir, manifest)
    return StageResult(spec.name, "ok", entry["seconds"], info=info)


def plan(recipe: Recipe, build_dir: Path | None = None,
         stages: Sequence[StageSpec] = STAGES) -> list[tuple[str, str | None]]:
    """For each stage: None when up to date, else why it would run."""
    build_dir = Path(build_dir or recipe.build_dir)
    manifest = read_manifest(build_dir)
    out: list[tuple[str, str | None]] = []
    upstream_changed: set[str] = set()
    for spec in stages:
        reason = stale_reason(spec, recipe, build_dir, manifest)
        if reason is None and upstream_changed & set(spec.depends):
            reason = "an upstream stage will rerun"
        if reason is not None:
            upstream_changed.add(spec.name)
        out.append((spec.name, reason))
    return out
