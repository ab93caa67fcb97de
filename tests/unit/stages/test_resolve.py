"""sources: local dirs, pkg: files found without importing, hf: cache misses, GGUF caching, resolve."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from dflash_fixtures import write_tiny_checkpoint

from dflash_trt.errors import DflashTrtError, NotImplementedStage, UsageError
from dflash_trt.stages import resolve as sources


@pytest.fixture
def fake_package(tmp_path, monkeypatch):
    """A package whose __init__ fails if imported, holding a checkpoint dir and a .gguf file."""
    root = tmp_path / "site"
    pkg = root / "boobytrapped_pkg"
    (pkg / "model").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise RuntimeError('imported!')\n")
    (pkg / "model" / "config.json").write_text("{}")
    (pkg / "weights.gguf").write_bytes(b"GGUF fake")
    monkeypatch.syspath_prepend(str(root))
    return pkg


def test_pkg_source_is_found_without_importing(fake_package):
    assert sources.resolve_source("pkg:boobytrapped_pkg/model") == (fake_package / "model").resolve()


@pytest.mark.parametrize("spec", ["boobytrapped_pkg/../x", "boobytrapped_pkg//etc/passwd",
                                  "boobytrapped_pkg/", "bad-name/x", "os.path/x"])
def test_pkg_paths_cannot_escape(fake_package, spec):
    with pytest.raises(UsageError):
        sources.locate_package_file(spec)


def test_pkg_symlink_out_of_the_package_is_refused(fake_package, tmp_path):
    (fake_package / "link").symlink_to(tmp_path)
    with pytest.raises(UsageError, match="inside the package"):
        sources.locate_package_file("boobytrapped_pkg/link")


def test_pkg_missing_package_and_file(fake_package):
    with pytest.raises(DflashTrtError, match="not installed"):
        sources.resolve_source("pkg:no_such_package_zz/x.gguf")
    with pytest.raises(DflashTrtError, match="no file"):
        sources.resolve_source("pkg:boobytrapped_pkg/absent.gguf")


def test_local_sources(tmp_path):
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(UsageError, match="no config.json"):
        sources.resolve_source(str(tmp_path / "ckpt"))
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    assert sources.resolve_source(str(tmp_path / "ckpt")) == tmp_path / "ckpt"
    with pytest.raises(UsageError, match="no such file"):
        sources.resolve_source(str(tmp_path / "missing"))


def test_hf_source_offline_and_absent_is_a_clear_error(monkeypatch):
    import huggingface_hub

    def offline(repo_id, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(DflashTrtError, match="hf:org/model is not in the Hugging Face cache"):
        sources.resolve_source("hf:org/model")
    with pytest.raises(UsageError):
        sources.resolve_source("hf:../../etc")


def test_hf_source_uses_the_cache_first(monkeypatch, tmp_path):
    import huggingface_hub

    (tmp_path / "config.json").write_text("{}")
    calls = []

    def cached(repo_id, **kwargs):
        calls.append(kwargs)
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", cached)
    assert sources.resolve_source("hf:org/model") == tmp_path
    assert calls == [{"local_files_only": True}]


def test_gguf_is_converted_once_per_content(fake_package, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    converted = []

    def fake_convert(gguf_path: Path, out: Path) -> None:
        converted.append(gguf_path)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(sources, "_write_plain_checkpoint", fake_convert)
    first = sources.resolve_source("pkg:boobytrapped_pkg/weights.gguf")
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes((fake_package / "weights.gguf").read_bytes())
    assert sources.resolve_source(str(copy)) == first  # same content: cache hit
    assert len(converted) == 1
    assert first.parent.parent == tmp_path / "cache"
    copy.write_bytes(b"GGUF other")
    assert sources.resolve_source(str(copy)) != first
    assert len(converted) == 2
    assert not [p for p in (tmp_path / "cache" / "gguf").iterdir() if p.name.startswith(".")]


def test_copy_checkpoint_follows_symlinks_within_the_checkpoint(tmp_path):
    # The Hugging Face cache: snapshots/REV/config.json -> ../../blobs/HASH
    model = tmp_path / "models--org--name"
    src, blob = model / "snapshots" / "rev", model / "blobs" / "abc"
    src.mkdir(parents=True)
    blob.parent.mkdir()
    blob.write_text("{}")
    (src / "config.json").symlink_to(blob)
    (src / "weights.bin").write_text("x")
    assert sources.copy_checkpoint(src, tmp_path / "out") == ["config.json"]
    assert not (tmp_path / "out" / "config.json").is_symlink()
    # A link out of the checkpoint (or out of a plain directory) is refused, nothing copied from it.
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    for checkpoint in (src, tmp_path / "plain"):
        checkpoint.mkdir(exist_ok=True)
        (checkpoint / "tokenizer.json").symlink_to(secret)
        with pytest.raises(UsageError, match="tokenizer.json: a link to .*outside the checkpoint"):
            sources.copy_checkpoint(checkpoint, tmp_path / "out2")


@dataclass
class _Recipe:
    target: object
    drafter: object


@dataclass
class _Ctx:
    recipe: _Recipe
    out: Path

    def progress(self, description, total=None):
        from dflash_trt.stages.pipeline import ProgressTask

        return ProgressTask(None, description, total)


def test_resolve_stage_writes_target_and_initialised_drafter(tmp_path):
    from dflash_trt.dflash.drafter import DFlashDraftModel
    from dflash_trt.recipe import DrafterInit, DrafterSection, TargetSection

    target = write_tiny_checkpoint(tmp_path / "src", "qwen3")
    recipe = _Recipe(TargetSection(source=str(target), dtype="bfloat16"),
                     DrafterSection(block_size=8, init=DrafterInit(num_layers=2, seed=3)))
    info = sources.run_resolve_stage(_Ctx(recipe, tmp_path / "out"))
    out = tmp_path / "out"
    assert json.loads((out / "target" / "config.json").read_text())["dtype"] == "bfloat16"
    assert (out / "target" / "tokenizer.json").is_file()
    drafter = DFlashDraftModel.from_pretrained(out / "drafter")
    assert (drafter.block_size, drafter.target_layer_ids, drafter.mask_token_id) == (8, [1, 1], 3)
    assert info["drafter"]["target_layer_ids"] == [1, 1]

    # An existing drafter is copied as is.
    again = _Recipe(recipe.target, DrafterSection(block_size=8, source=str(out / "drafter")))
    sources.run_resolve_stage(_Ctx(again, tmp_path / "out2"))
    assert (tmp_path / "out2" / "drafter" / "model.safetensors").read_bytes() == \
        (out / "drafter" / "model.safetensors").read_bytes()


def test_resolve_stage_refuses_training(tmp_path):
    from dflash_trt.recipe import DrafterInit, DrafterSection, DrafterTrain, TargetSection

    target = write_tiny_checkpoint(tmp_path / "src")
    recipe = _Recipe(TargetSection(source=str(target)),
                     DrafterSection(init=DrafterInit(), train=DrafterTrain(data=["builtin:chat"])))
    with pytest.raises(NotImplementedStage, match="not wired yet"):
        sources.run_resolve_stage(_Ctx(recipe, tmp_path / "out"))
