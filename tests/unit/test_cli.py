"""The CLI edge: exit codes, one-line errors, fast --help, generated docs kept current."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_trt.cli import cli

ROOT = Path(__file__).resolve().parents[2]
GOOD = """\
name: tiny
output_dir: {out}
target: {{source: hf:org/model}}
drafter: {{block_size: 4, init: {{num_layers: 1}}}}
"""


def run(*args):
    return CliRunner().invoke(cli, list(args))


def test_help_does_not_import_heavy_modules():
    code = ("import sys; from dflash_trt.cli import main; sys.argv=['dflash-trt','--help']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('torch','transformers','modelopt','tritonclient','numpy')"
            " if m in sys.modules]\nprint('HEAVY', heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "HEAVY []" in out.stdout, out.stdout
    assert "validate" in out.stdout and "build" in out.stdout


def test_version():
    result = run("--version")
    assert result.exit_code == 0 and "dflash-trt" in result.output


def test_validate_shipped_recipes():
    result = run("validate", *map(str, sorted((ROOT / "recipes").glob("*.yaml"))))
    assert result.exit_code == 0, result.output
    assert result.output.count("ok  ") == 4


def test_validate_bad_recipe_exit_2_no_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntarget: {source: hf:a/b}\ndrafter: {block_size: 99, init: {}}\n")
    result = run("validate", str(bad))
    assert result.exit_code == 2
    assert "drafter.block_size" in result.output and ":3:" in result.output
    assert "Traceback" not in result.output


def test_validate_reports_every_file(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(GOOD.format(out=tmp_path))
    bad = tmp_path / "bad.yaml"
    bad.write_text("[]")
    result = run("validate", str(good), str(bad))
    assert result.exit_code == 2
    assert "ok  " in result.output and "must be a mapping" in result.output


def test_plan_fresh_build(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(GOOD.format(out=tmp_path / "build"))
    result = run("plan", str(recipe), "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [r["stage"] for r in rows] == ["resolve", "quantize", "verify", "compile", "emit"]
    assert all(r["reason"] == "never run" for r in rows[:1])


def test_build_unknown_stage_is_usage_error(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(GOOD.format(out=tmp_path / "build"))
    result = run("build", str(recipe), "--only", "compiel")
    assert result.exit_code == 2
    assert "unknown stage 'compiel'" in result.output


def test_build_missing_recipe_is_usage_error(tmp_path):
    result = run("build", str(tmp_path / "nope.yaml"))
    assert result.exit_code == 2 and "file not found" in result.output


def test_schema_is_json_schema():
    result = run("schema")
    assert result.exit_code == 0
    schema = json.loads(result.output)
    assert schema["title"] == "Recipe" and "drafter" in schema["properties"]


def test_recipe_docs_are_current():
    result = run("schema", "--format", "markdown")
    assert result.exit_code == 0
    assert (ROOT / "docs" / "recipe.md").read_text() == result.output, (
        "docs/recipe.md is stale: run `dflash-trt schema --format markdown > docs/recipe.md`")


def test_doctor_json_lists_checks():
    result = run("doctor", "--json")
    assert result.exit_code == 0, result.output
    names = {c["name"] for c in json.loads(result.output)}
    assert {"python", "torch", "tritonserver", "tensorrt_llm"} <= names


def test_internal_errors_are_one_line_unless_debug(monkeypatch, tmp_path):
    import dflash_trt.recipe as recipe_mod

    def broken(path):
        raise RuntimeError("kaput")

    monkeypatch.setattr(recipe_mod, "load_recipe", broken)
    result = run("validate", "x.yaml")
    assert result.exit_code == 1
    assert "internal error: RuntimeError: kaput" in result.output and "--debug" in result.output
    result = run("--debug", "validate", "x.yaml")
    assert isinstance(result.exception, RuntimeError)


@pytest.mark.parametrize(("capability", "flashinfer", "ok"), [
    ((10, 0), "0.3.1", True), ((9, 0), "0.3.1", False), ((10, 0), None, False)])
def test_doctor_on_a_gpu_checks_the_dflash_attention_backends(monkeypatch, capability,
                                                             flashinfer, ok):
    import torch

    from dflash_trt import doctor

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "a GPU")
    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda dist: flashinfer if dist == "flashinfer-python"
                        else None if dist == "flash-attn" else real(dist))
    checks = {c.name: c for c in doctor._torch()}
    assert checks["DFlash TRTLLM attention"].ok is ok
    assert not checks["flash-attn (DFlash VANILLA attention)"].ok  # not installed here
