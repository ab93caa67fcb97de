"""The emit stage: templates, config.pbtxt parsed with Triton's schema, a self-contained repo."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trt.engines.spec import EngineSpec
from dflash_trt.errors import DflashTrtError
from dflash_trt.recipe import TritonSection
from dflash_trt.stages.emit import emit_repository, instance_kind, render_config, templates_dir

CHECKOUT_TEMPLATES = Path(__file__).resolve().parents[3] / "triton_repo"


def fake_engine(root: Path, backend="torch", device="cpu", max_batch_size=2) -> Path:
    engine = root / "engine"
    (engine / "target").mkdir(parents=True)
    (engine / "target" / "model.safetensors").write_bytes(b"weights")
    EngineSpec(backend=backend, target="target", drafter=None, dtype="float32", device=device,
               block_size=1, max_batch_size=max_batch_size, max_seq_len=128,
               chat_template=False).write(engine)
    return engine


def parse_config(path: Path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def test_packaged_templates_are_the_checkout_templates():
    # One source of truth: the package reaches the checkout's triton_repo/ through a link.
    packaged = templates_dir()
    assert CHECKOUT_TEMPLATES.resolve() == packaged.resolve()
    files = sorted(p.relative_to(packaged) for p in packaged.rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts)
    assert files == [Path("dflash/1/model.py"), Path("dflash/config.pbtxt")]


def test_emit_writes_a_self_contained_decoupled_cpu_model(tmp_path):
    engine = fake_engine(tmp_path)
    model_dir = emit_repository(engine, tmp_path / "repo", TritonSection(instance_count=2), "cpu")
    config = parse_config(model_dir / "config.pbtxt")
    assert config.name == "dflash" and config.backend == "python"
    assert config.model_transaction_policy.decoupled
    assert config.max_batch_size == 2
    assert [(g.count, g.kind) for g in config.instance_group] == [(2, 2)]  # KIND_CPU
    inputs = {i.name: i for i in config.input}
    assert not inputs["text_input"].optional and inputs["max_tokens"].optional
    assert {o.name for o in config.output} == {"text_output", "output_token_ids",
                                               "total_draft_tokens",
                                               "total_accepted_draft_tokens", "acceptance_length",
                                               "acceptance_rate"}
    # every input the model reads is declared, and nothing else
    from dflash_trt.serving.requests import INPUTS

    assert set(inputs) == set(INPUTS)
    assert (model_dir / "1" / "model.py").read_text() == \
        (CHECKOUT_TEMPLATES / "dflash" / "1" / "model.py").read_text()
    copied = model_dir / "1" / "engine" / "target" / "model.safetensors"
    assert copied.read_bytes() == b"weights"
    assert not os.path.samefile(copied, engine / "target" / "model.safetensors")
    assert EngineSpec.read(model_dir / "1" / "engine").target == "target"


def test_the_ensemble_routes_every_input_and_output_to_the_model(tmp_path):
    from dflash_trt.stages.emit import emit_ensemble

    engine = fake_engine(tmp_path)
    model_dir = emit_repository(engine, tmp_path / "repo", TritonSection(), "cpu")
    ensemble_dir = emit_ensemble(model_dir, "ensemble")
    model, ensemble = parse_config(model_dir / "config.pbtxt"), parse_config(
        ensemble_dir / "config.pbtxt")
    assert ensemble.name == "ensemble" and ensemble.platform == "ensemble"
    assert ensemble.max_batch_size == model.max_batch_size
    assert list(ensemble.input) == list(model.input) and list(ensemble.output) == list(model.output)
    (step,) = ensemble.ensemble_scheduling.step
    assert step.model_name == "dflash" and step.model_version == -1
    assert dict(step.input_map) == {i.name: i.name for i in model.input}
    assert dict(step.output_map) == {o.name: o.name for o in model.output}
    assert (ensemble_dir / "1").is_dir()
    with pytest.raises(DflashTrtError, match="already exists"):
        emit_ensemble(model_dir, "ensemble")


def test_emit_can_hard_link_the_engine(tmp_path):
    engine = fake_engine(tmp_path)
    model_dir = emit_repository(engine, tmp_path / "repo", TritonSection(model_name="m"), "cpu",
                                link=True)
    assert os.path.samefile(model_dir / "1" / "engine" / "target" / "model.safetensors",
                            engine / "target" / "model.safetensors")


def test_not_decoupled_and_renamed(tmp_path):
    engine = fake_engine(tmp_path)
    section = TritonSection(model_name="dflash_sync", decoupled=False)
    config = parse_config(emit_repository(engine, tmp_path / "r", section, "cpu") / "config.pbtxt")
    assert config.name == "dflash_sync" and not config.model_transaction_policy.decoupled


@pytest.mark.parametrize("hardware, backend, device, kind", [
    ("cpu", "torch", "cpu", "KIND_CPU"),
    ("sm90", "torch", "cuda", "KIND_GPU"),
    ("sm90", "torch", "cpu", "KIND_CPU"),
    ("sm100", "tensorrt_llm", "cuda", "KIND_MODEL"),
])
def test_instance_kind_by_hardware(tmp_path, hardware, backend, device, kind):
    spec = EngineSpec.read(fake_engine(tmp_path, backend=backend, device=device))
    assert instance_kind(hardware, spec) == kind


def test_missing_placeholder_fails():
    with pytest.raises(DflashTrtError, match="placeholder 'max_batch_size'"):
        render_config("name: \"${model_name}\"\nmax_batch_size: ${max_batch_size}\n",
                      {"model_name": "x"})


def test_config_that_triton_would_reject_fails_before_it_is_written():
    with pytest.raises(DflashTrtError, match="does not parse"):
        render_config("name: \"x\"\nmax_batch_size: ${n}\n", {"n": "$"})
    with pytest.raises(DflashTrtError, match="does not parse"):
        render_config("name: \"x\"\nmax_batchsize: 1\n", {})


def test_emit_refuses_an_existing_model_dir(tmp_path):
    engine = fake_engine(tmp_path)
    (tmp_path / "repo" / "dflash").mkdir(parents=True)
    with pytest.raises(DflashTrtError, match="already exists"):
        emit_repository(engine, tmp_path / "repo", TritonSection(), "cpu")


def test_installed_package_emits_from_any_working_directory(tmp_path):
    engine = fake_engine(tmp_path)
    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    code = ("import sys; from pathlib import Path; from dflash_trt.recipe import TritonSection; "
            "from dflash_trt.stages.emit import emit_repository; "
            "print(emit_repository(Path(sys.argv[1]), Path('repo'), TritonSection(), 'cpu'))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code, str(engine)], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (workdir / "repo" / "dflash" / "config.pbtxt").is_file()
    assert (workdir / "repo" / "dflash" / "1" / "model.py").is_file()
