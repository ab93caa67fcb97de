"""Recipe validation: every shipped recipe passes; every kind of mistake fails with its position."""

import time
from pathlib import Path

import pytest
import yaml

from dflash_trt.errors import RecipeError
from dflash_trt.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[3]
SHIPPED = sorted((ROOT / "recipes").glob("*.yaml"))

GOOD = """\
name: tiny
hardware: cpu
target:
  source: hf:org/model
drafter:
  block_size: 4
  init: {num_layers: 1}
"""


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def errors_of(path: Path) -> list[str]:
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert info.value.exit_code == 2
    return info.value.findings


def test_shipped_recipes_exist_and_validate():
    names = {p.name for p in SHIPPED}
    assert {"smollm2-135m-cpu.yaml", "qwen3-8b-nvfp4-b200.yaml", "llama3.1-8b-fp8-h200.yaml",
            "gpt-oss-120b-nvfp4-gb200.yaml"} <= names
    for path in SHIPPED:
        recipe = load_recipe(path)
        assert recipe.name == path.stem


def test_gpt_oss_uses_block_size_10():
    assert load_recipe(ROOT / "recipes/gpt-oss-120b-nvfp4-gb200.yaml").drafter.block_size == 10


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_misspelled_key_in_shipped_recipe_fails(tmp_path, path):
    data = yaml.safe_load(path.read_text())
    data["engine"]["max_seq_lenn"] = data["engine"].pop("max_seq_len", 4096)
    data["output_dir"] = str(tmp_path)
    bad = write(tmp_path, yaml.safe_dump(data))
    (finding,) = [f for f in errors_of(bad) if "max_seq_lenn" in f]
    assert "engine.max_seq_lenn: unknown key" in finding and "max_seq_len" in finding


def test_good_minimal_recipe_defaults(tmp_path):
    r = load_recipe(write(tmp_path, GOOD))
    assert r.engine.backend == "torch" and r.triton.model_name == "dflash"
    assert Path(r.output_dir) == (tmp_path / "build").resolve()
    assert r.build_dir.name == "tiny"


def test_recipe_is_frozen(tmp_path):
    r = load_recipe(write(tmp_path, GOOD))
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="frozen"):
        r.name = "other"


@pytest.mark.parametrize("text, where, needle", [
    (GOOD.replace("block_size: 4", "block_size: 4\n  extra: 1"), "drafter.extra",
     "unknown key"),
    (GOOD + "engine:\n  max_batch_size: lots\n", "engine.max_batch_size", "valid integer"),
    (GOOD.replace("block_size: 4", "block_size: 64"), "drafter.block_size", "less than or equal"),
    (GOOD.replace("block_size: 4", "block_size: 1"), "drafter.block_size", "greater than"),
    (GOOD + "quantize:\n  target: {format: nvfp5}\n", "quantize.target.format", "'nvfp4'"),
    (GOOD.replace("hardware: cpu", "hardware: sm70"), "hardware", "'sm90'"),
    (GOOD.replace("name: tiny", "name: ../etc"), "name", "names directories"),
    (GOOD.replace("name: tiny", "name: a/b"), "name", "names directories"),
    (GOOD.replace("hf:org/model", "./missing-model"), "target.source", "does not exist"),
    (GOOD.replace("hf:org/model", "hf:not a name"), "target.source", "hf:<org>/<name>"),
    (GOOD.replace("hf:org/model", "pkg:pkg/../../etc/passwd"), "target.source", "inside"),
    (GOOD.replace("hf:org/model", "s3://bucket/model"), "target.source", "unknown source"),
    (GOOD.replace("  init: {num_layers: 1}\n", ""), "drafter", "exactly one"),
    (GOOD + "verify:\n  prompts: builtin:nope\n", "verify.prompts", "builtin"),
    (GOOD + "quantize:\n  calibration:\n    data: [missing.txt]\n",
     "quantize.calibration.data[0]", "does not exist"),
    (GOOD + "triton:\n  model_name: 'bad name'\n", "triton.model_name", "names directories"),
    (GOOD.replace("target:\n  source: hf:org/model", "target: 5"), "target", "dictionary"),
    (GOOD.replace("name: tiny\n", ""), "name", "required key is missing"),
])
def test_bad_values_report_dotted_path(tmp_path, text, where, needle):
    findings = errors_of(write(tmp_path, text))
    match = [f for f in findings if f": {where}: " in f]
    assert match, findings
    assert needle in match[0], match[0]


def test_all_errors_reported_together_with_line_and_column(tmp_path):
    text = GOOD.replace("block_size: 4", "block_size: 99\n  bogus: 1").replace(
        "hardware: cpu", "hardware: tpu")
    findings = errors_of(write(tmp_path, text))
    assert len(findings) == 3
    lines = {f.split(": ", 1)[1].split(":")[0] for f in findings}
    assert lines == {"hardware", "drafter.block_size", "drafter.bogus"}
    hw = next(f for f in findings if "hardware" in f)
    assert hw.startswith(f"{tmp_path / 'r.yaml'}:2:1: ")
    bogus = next(f for f in findings if "bogus" in f)
    assert ":7:3: " in bogus


def test_deep_unknown_key_has_its_line(tmp_path):
    text = GOOD + "quantize:\n  calibration:\n    calib_sise: 3\n"
    (finding,) = errors_of(write(tmp_path, text))
    assert ":10:5: quantize.calibration.calib_sise: unknown key" in finding
    assert "calib_size" in finding  # the valid keys are listed


@pytest.mark.parametrize("hardware, fmt, ok", [
    ("sm90", "nvfp4", False), ("sm90", "fp8", True), ("sm100", "nvfp4", True),
    ("sm103", "nvfp4", True), ("sm120", "nvfp4", False), ("sm90", "w4a16_nvfp4", False),
])
def test_nvfp4_with_tensorrt_llm_needs_blackwell(tmp_path, hardware, fmt, ok):
    text = GOOD.replace("hardware: cpu", f"hardware: {hardware}") + (
        f"quantize:\n  target: {{format: {fmt}}}\nengine:\n  backend: tensorrt_llm\n")
    path = write(tmp_path, text)
    if ok:
        load_recipe(path)
        return
    (finding,) = errors_of(path)
    assert "quantize.target.format" in finding and "fp8" in finding and "sm100" in finding


def test_nvfp4_with_torch_engine_is_fine_on_cpu(tmp_path):
    load_recipe(write(tmp_path, GOOD + "quantize:\n  target: {format: nvfp4}\n"))


@pytest.mark.parametrize("extra, where", [
    ("engine:\n  backend: tensorrt_llm\n", "engine.backend"),
    ("engine:\n  tensor_parallel_size: 2\n", "engine.tensor_parallel_size"),
    ("engine:\n  device: cuda\n", "engine.device"),
    ("engine:\n  build_path: trtllm_build\n", "engine.build_path"),
    ("engine:\n  backend: tensorrt_llm\n  prompt_lookup: true\n", "engine.prompt_lookup"),
])
def test_contradictions(tmp_path, extra, where):
    findings = errors_of(write(tmp_path, GOOD + extra))
    assert any(f": {where}: " in f for f in findings), findings


FLEET = GOOD.replace("hardware: cpu", "hardware: sm100") + "engine:\n  backend: tensorrt_llm\n"


@pytest.mark.parametrize(("extra", "where", "words"), [
    ("quantize:\n  drafter: {format: fp8}\n", "quantize.drafter.format", "plain weights"),
    ("  dtype: float32\n", "engine.dtype", "bfloat16 or float16"),
    ("triton:\n  instance_count: 2\n", "triton.instance_count", "gpu_device_ids"),
    ("  draft_len_schedule: {2: 2, 8: 1}\n", "engine.draft_len_schedule", "smallest batch"),
    ("  draft_len_schedule: {1: 3, 8: 4}\n", "engine.draft_len_schedule", "none more"),
])
def test_what_tensorrt_llm_cannot_serve_is_refused_at_its_field(tmp_path, extra, where, words):
    findings = errors_of(write(tmp_path, FLEET + extra))  # "  ..." lines extend engine:
    assert any(f": {where}: " in f and words in f for f in findings), findings


@pytest.mark.parametrize("engine_dtype", ["", "  dtype: auto\n"])
def test_a_float32_target_needs_an_explicit_half_dtype_for_tensorrt_llm(tmp_path, engine_dtype):
    text = FLEET.replace("  source: hf:org/model\n", "  source: hf:org/model\n  dtype: float32\n")
    findings = errors_of(write(tmp_path, text + engine_dtype))
    assert any(": engine.dtype: " in f and "would serve float32" in f for f in findings), findings
    load_recipe(write(tmp_path, text + "  dtype: bfloat16\n"))  # explicit bf16 is fine


def test_a_valid_schedule_loads_and_the_torch_engine_refuses_one(tmp_path):
    recipe = load_recipe(write(tmp_path, FLEET + "  draft_len_schedule: {1: 3, 8: 1, 32: 0}\n"))
    assert recipe.engine.draft_len_schedule == {1: 3, 8: 1, 32: 0}
    findings = errors_of(write(tmp_path, GOOD + "engine:\n  draft_len_schedule: {1: 3}\n"))
    assert any(": engine.draft_len_schedule: " in f for f in findings), findings


def test_trtllm_build_error_explains_why(tmp_path):
    text = GOOD.replace("hardware: cpu", "hardware: sm100") + (
        "engine:\n  backend: tensorrt_llm\n  build_path: trtllm_build\n")
    (finding,) = errors_of(write(tmp_path, text))
    assert "removed" in finding and "DFlash" in finding and "llm_api" in finding


def test_relative_paths_resolve_against_recipe_dir(tmp_path, monkeypatch):
    model = tmp_path / "models" / "tiny"
    model.mkdir(parents=True)
    sub = tmp_path / "recipes"
    sub.mkdir()
    path = write(sub, GOOD.replace("hf:org/model", "../models/tiny"))
    monkeypatch.chdir("/")
    assert load_recipe(path).target.source == str(model)


@pytest.mark.parametrize("text, needle", [
    ("", "empty"),
    ("# only a comment\n", "empty"),
    ("- a\n- b\n", "must be a mapping"),
    ("just a string\n", "must be a mapping"),
    ("name: a\nname: b\n", "duplicate key 'name'"),
    ("name: [unclosed\n", "invalid YAML"),
    ("a: &a [*a]\n", "recursive"),
    ("!!python/object:os.system {}\n", "invalid YAML"),
])
def test_malformed_yaml(tmp_path, text, needle):
    (finding,) = errors_of(write(tmp_path, text))
    assert needle in finding


def test_duplicate_key_reports_its_line(tmp_path):
    (finding,) = errors_of(write(tmp_path, GOOD + "drafter: {}\n"))
    assert ":8:1: duplicate key 'drafter' (first at line 5)" in finding


def test_alias_bomb_rejected_fast(tmp_path):
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, cur in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{cur}: &{cur} [" + ",".join([f"*{prev}"] * 9) + "]")
    path = write(tmp_path, "\n".join(lines) + "\n")
    t0 = time.perf_counter()
    (finding,) = errors_of(path)
    assert "alias bomb" in finding
    assert time.perf_counter() - t0 < 5  # a guard against hanging, not a benchmark


def test_missing_file():
    with pytest.raises(RecipeError) as info:
        load_recipe("/nonexistent/recipe.yaml")
    assert "file not found" in info.value.message


def test_the_torch_engine_batches_in_float32_only(tmp_path):
    """bf16 verifies with row-wise attention (batch 1): batching it is refused at its field;
    auto and float32 batch (auto picks float32 then: stages.devices.engine_dtype)."""
    findings = errors_of(write(tmp_path, GOOD + "engine:\n  max_batch_size: 4\n"))
    assert any(": engine.max_batch_size: " in f and "float32 only" in f for f in findings), findings
    for dtype in ("auto", "float32"):
        load_recipe(write(tmp_path, GOOD + f"engine:\n  max_batch_size: 4\n  dtype: {dtype}\n"))
    load_recipe(write(tmp_path, GOOD + "engine:\n  max_batch_size: 1\n"))
