"""The pipeline runner, exercised with small test stages that write real files."""

import json
from pathlib import Path

import pytest

from dflash_trt.errors import DflashTrtError, NotImplementedStage, UsageError
from dflash_trt.recipe import validate_recipe
from dflash_trt.stages.pipeline import StageSpec, plan, read_manifest, run_pipeline

CALLS: list[str] = []


def make_recipe(tmp_path: Path, block_size: int = 4, max_tokens: int = 16):
    return validate_recipe({
        "name": "t", "output_dir": str(tmp_path / "build"),
        "target": {"source": "hf:org/model"},
        "drafter": {"block_size": block_size, "init": {"num_layers": 1}},
        "triton": {"max_tokens": max_tokens},
    })


def first(ctx):
    CALLS.append("first")
    (ctx.out / "a.txt").write_text(f"block={ctx.recipe.drafter.block_size}")
    return {"wrote": "a.txt"}


def second(ctx):
    CALLS.append("second")
    upstream = (ctx.stage_dir("first") / "a.txt").read_text()
    (ctx.out / "b.txt").write_text(upstream + f" tokens={ctx.recipe.triton.max_tokens}")


def exploding(ctx):
    CALLS.append("exploding")
    (ctx.out / "half.txt").write_text("half written")
    raise DflashTrtError("boom")


def stages(second_impl=second):
    return (
        StageSpec("first", "one", ("drafter",), (), first),
        StageSpec("second", "two", ("triton",), ("first",), second_impl),
    )


@pytest.fixture(autouse=True)
def clear_calls():
    CALLS.clear()


def statuses(results):
    return [(r.name, r.status) for r in results]


def test_runs_then_skips_when_unchanged(tmp_path):
    r = make_recipe(tmp_path)
    assert statuses(run_pipeline(r, stages=stages())) == [("first", "ok"), ("second", "ok")]
    assert (r.build_dir / "two" / "b.txt").read_text() == "block=4 tokens=16"
    assert statuses(run_pipeline(r, stages=stages())) == [("first", "skipped"),
                                                          ("second", "skipped")]
    assert CALLS == ["first", "second"]
    manifest = read_manifest(r.build_dir)
    assert manifest["stages"]["first"]["status"] == "ok"
    assert manifest["stages"]["first"]["info"] == {"wrote": "a.txt"}
    assert set(manifest["stages"]["second"]["outputs"]) == {"b.txt"}


def test_change_in_own_section_reruns_only_that_stage(tmp_path):
    run_pipeline(make_recipe(tmp_path), stages=stages())
    CALLS.clear()
    results = run_pipeline(make_recipe(tmp_path, max_tokens=32), stages=stages())
    assert statuses(results) == [("first", "skipped"), ("second", "ok")]
    assert CALLS == ["second"]


def test_upstream_change_reruns_downstream(tmp_path):
    run_pipeline(make_recipe(tmp_path), stages=stages())
    CALLS.clear()
    r = make_recipe(tmp_path, block_size=8)
    assert [why is None for _, why in plan(r, stages=stages())] == [False, False]
    run_pipeline(r, stages=stages())
    assert CALLS == ["first", "second"]
    assert (r.build_dir / "two" / "b.txt").read_text() == "block=8 tokens=16"


def test_tampered_output_reruns(tmp_path):
    r = make_recipe(tmp_path)
    run_pipeline(r, stages=stages())
    (r.build_dir / "two" / "b.txt").write_text("tampered, longer than before")
    assert plan(r, stages=stages())[1] == ("second", "outputs missing or modified")
    CALLS.clear()
    run_pipeline(r, stages=stages())
    assert CALLS == ["second"]
    assert (r.build_dir / "two" / "b.txt").read_text() == "block=4 tokens=16"


def test_failed_stage_keeps_previous_good_output(tmp_path):
    r = make_recipe(tmp_path)
    run_pipeline(r, stages=stages())
    r2 = make_recipe(tmp_path, max_tokens=99)
    with pytest.raises(DflashTrtError, match="boom"):
        run_pipeline(r2, stages=stages(exploding))
    out = r.build_dir / "two"
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]
    assert (out / "b.txt").read_text() == "block=4 tokens=16"
    assert not list(r.build_dir.glob(".two.tmp-*"))
    entry = read_manifest(r.build_dir)["stages"]["second"]
    assert entry["status"] == "failed" and entry["error"] == "boom"
    # a failed stage never counts as up to date
    assert plan(r, stages=stages())[1] == ("second", "last run failed")


def test_failure_midway_on_first_build_leaves_nothing(tmp_path):
    r = make_recipe(tmp_path)
    with pytest.raises(DflashTrtError):
        run_pipeline(r, stages=stages(exploding))
    assert not (r.build_dir / "two").exists()
    assert (r.build_dir / "one" / "a.txt").exists()


def test_interrupt_leaves_no_temp_dir(tmp_path):
    def interrupted(ctx):
        (ctx.out / "x").write_text("x")
        raise KeyboardInterrupt

    r = make_recipe(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(r, stages=stages(interrupted))
    assert not (r.build_dir / "two").exists()
    assert not [p for p in r.build_dir.iterdir() if ".tmp-" in p.name]
    assert read_manifest(r.build_dir)["stages"]["second"]["status"] == "interrupted"


def test_stale_temp_dirs_from_a_killed_run_are_removed(tmp_path):
    r = make_recipe(tmp_path)
    stale = r.build_dir / ".two.tmp-12345"
    stale.mkdir(parents=True)
    (stale / "b.txt").write_text("half")
    run_pipeline(r, stages=stages())
    assert not stale.exists()


def test_force_reruns_an_up_to_date_stage(tmp_path):
    r = make_recipe(tmp_path)
    run_pipeline(r, stages=stages())
    CALLS.clear()
    results = run_pipeline(r, stages=stages(), force=["first"])
    # forcing first changes its output fingerprint, so second reruns too
    assert statuses(results) == [("first", "ok"), ("second", "ok")]


def test_only_runs_selected_stage(tmp_path):
    r = make_recipe(tmp_path)
    assert statuses(run_pipeline(r, stages=stages(), only=["first"])) == [("first", "ok")]
    assert not (r.build_dir / "two").exists()
    CALLS.clear()
    assert statuses(run_pipeline(r, stages=stages(), only=["second"])) == [("second", "ok")]
    assert CALLS == ["second"]


def test_only_without_upstream_output_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="needs the output of 'first'"):
        run_pipeline(make_recipe(tmp_path), stages=stages(), only=["second"])


def test_unknown_stage_names(tmp_path):
    with pytest.raises(UsageError, match="unknown stage 'thrid'"):
        run_pipeline(make_recipe(tmp_path), stages=stages(), only=["thrid"])
    with pytest.raises(UsageError, match="unknown stage"):
        run_pipeline(make_recipe(tmp_path), stages=stages(), force=["nope"])


def test_unimplemented_stage_is_reported_not_faked(tmp_path):
    spec = (StageSpec("later", "later", (), (), "dflash_trt.not_a_module:run"),)
    r = make_recipe(tmp_path)
    with pytest.raises(NotImplementedStage, match="not implemented"):
        run_pipeline(r, stages=spec)
    assert read_manifest(r.build_dir)["stages"]["later"]["status"] == "not_implemented"
    assert not (r.build_dir / "later").exists()


def test_manifest_is_valid_json_with_timings(tmp_path):
    r = make_recipe(tmp_path)
    run_pipeline(r, stages=stages())
    data = json.loads((r.build_dir / "manifest.json").read_text())
    for name in ("first", "second"):
        entry = data["stages"][name]
        assert entry["seconds"] >= 0 and entry["started"] and len(entry["output_hash"]) == 64
        assert set(entry["inputs"]) == {"recipe", "files", "upstream", "tools"}


def test_local_input_file_change_reruns(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    r = validate_recipe({"name": "t", "output_dir": str(tmp_path / "build"),
                         "target": {"source": str(model)},
                         "drafter": {"block_size": 4, "init": {}}})
    spec = (StageSpec("first", "one", ("target",), (), first),)
    run_pipeline(r, stages=spec)
    assert plan(r, stages=spec) == [("first", None)]
    (model / "config.json").write_text('{"changed": true}')
    assert plan(r, stages=spec) == [("first", "local input files changed")]


def test_bytecode_caches_written_by_serving_do_not_make_a_stage_stale(tmp_path):
    r = make_recipe(tmp_path)
    run_pipeline(r, stages=stages())
    cache = r.build_dir / "two" / "__pycache__"
    cache.mkdir()
    (cache / "model.cpython-311.pyc").write_bytes(b"\0")
    assert plan(r, stages=stages())[1] == ("second", None)


def test_a_dotted_section_hashes_only_that_field(tmp_path):
    dotted = (StageSpec("first", "one", ("drafter.block_size",), (), first),)
    run_pipeline(make_recipe(tmp_path), stages=dotted)
    r = validate_recipe({"name": "t", "output_dir": str(tmp_path / "build"),
                         "target": {"source": "hf:org/model"},
                         "drafter": {"block_size": 4, "init": {"num_layers": 2}}})
    assert plan(r, stages=dotted) == [("first", None)]  # another drafter field: up to date
    assert plan(make_recipe(tmp_path, block_size=8), stages=dotted)[0][1] is not None


def test_shipped_stages_rerun_verify_and_compile_on_what_they_read():
    from dflash_trt.stages.pipeline import STAGES, stage_by_name

    verify, compile_ = stage_by_name("verify", STAGES), stage_by_name("compile", STAGES)
    assert {"engine.backend", "engine.dtype", "engine.device"} <= set(verify.sections)
    assert "verify" in compile_.depends  # the calibration and the draft_len_schedule
