"""engines.cost_model: measured step costs, stored with the device they were measured on."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from click.testing import CliRunner
from dflash_fixtures import write_tiny_checkpoint

from dflash_trt.cli import cli
from dflash_trt.engines.cost_model import (
    COST_MODEL_FILE,
    CostModel,
    cost_model_for,
    device_identity,
    measure,
    timed_rounds,
)
from dflash_trt.errors import DflashTrtError


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    """An engine directory as the compile stage writes it: engine.yaml, target/, drafter/."""
    from dflash_trt.engines.spec import EngineSpec

    root = tmp_path_factory.mktemp("cost")
    target = write_tiny_checkpoint(root / "target")
    result = CliRunner().invoke(cli, ["init-drafter", "--target", str(target), "--output",
                                      str(root / "drafter"), "--block-size", "4",
                                      "--target-layer-ids", "0,2", "--seed", "1"])
    assert result.exit_code == 0, result.output
    EngineSpec(backend="torch", target="target", drafter="drafter", dtype="float32",
               device="cpu", block_size=4, max_batch_size=1, max_seq_len=256,
               chat_template=True, draft_length="adaptive").write(root)
    return root


@pytest.fixture(scope="module")
def engine(engine_dir):
    from dflash_trt.engines.torch_engine import TorchEngine

    return TorchEngine.load(engine_dir / "target", engine_dir / "drafter", max_seq_len=256)


def test_measure_times_every_verify_width_and_the_draft(engine):
    model = measure(engine, context_tokens=16, repeats=2)
    assert len(model.costs.verify_s) == engine.block_size == 4
    assert all(s > 0 for s in model.costs.verify_s) and model.costs.draft_s > 0
    assert model.identity() == device_identity("cpu", "float32")
    assert model.device == "cpu" and model.device_name and model.threads >= 1


def test_timed_rounds_time_every_shape_once_per_round_so_drift_spreads_over_all(monkeypatch):
    """Round-robin, after one untimed call of each: a machine slowing down between rounds slows
    every shape alike, and each shape's median keeps the ratios between shapes."""
    from dflash_trt.engines import cost_model

    clock, calls = [0.0], []
    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: clock[0])

    def shape(name: str, seconds: float):
        def run():
            calls.append(name)
            clock[0] += seconds * (1 + calls.count(name))  # this machine slows down as it runs
        return run

    medians = timed_rounds([shape("a", 1.0), shape("b", 2.0)], repeats=3)
    assert calls == ["a", "b"] * 4  # the warm-up round, then 3 timed rounds
    assert medians == [4.0, 8.0]  # the middle round of each: b costs 2x a, as it does


def test_round_trip_and_reuse_on_the_same_device(engine, tmp_path):
    model = measure(engine, context_tokens=16, repeats=2)
    model.write(tmp_path)
    assert CostModel.read(tmp_path) == model
    assert cost_model_for(engine, tmp_path) == model  # same device kind and dtype: trusted
    # Rewritten as a new file: a hard-linked copy (the Triton repository's engine/) keeps its own.
    linked = tmp_path / "repo"
    linked.mkdir()
    os.link(tmp_path / COST_MODEL_FILE, linked / COST_MODEL_FILE)
    dataclasses.replace(model, device="elsewhere").write(linked)
    assert CostModel.read(tmp_path) == model
    assert CostModel.read(linked).device == "elsewhere"


def test_a_batching_engine_measures_its_batch_sizes_and_interpolates(engine, tmp_path):
    from dflash_trt.engines.cost_model import batch_sizes

    assert batch_sizes(1) == [] and batch_sizes(4) == [2, 4] and batch_sizes(6) == [2, 4, 6]
    single = measure(engine, context_tokens=16, repeats=2)
    single.write(tmp_path)
    engine.max_batch_size = 4
    try:
        model = cost_model_for(engine, tmp_path)  # the stored one has no batches: measured again
        assert sorted(model.batches) == [2, 4]
        assert all(len(c.verify_s) == 4 and min(c.verify_s) > 0 for c in model.batches.values())
        model.write(tmp_path)
        assert CostModel.read(tmp_path) == model and cost_model_for(engine, tmp_path) == model
        two, four = model.step_s(2, 3), model.step_s(4, 3)
        assert model.step_s(3, 3) == pytest.approx((two + four) / 2)
        assert model.step_s(8, 3) == pytest.approx(2 * four)
    finally:
        engine.max_batch_size = 1


def test_a_cost_model_from_another_device_is_measured_again(engine, tmp_path):
    model = measure(engine, context_tokens=16, repeats=2)
    model.write(tmp_path)
    path = tmp_path / COST_MODEL_FILE
    data = json.loads(path.read_text())
    data.update(device="cuda", device_name="NVIDIA H200")
    path.write_text(json.dumps(data))
    fresh = cost_model_for(engine, tmp_path)
    assert fresh.identity() == device_identity("cpu", "float32") != CostModel.read(tmp_path).identity()


def test_a_broken_cost_model_file_is_a_clear_error(tmp_path):
    (tmp_path / COST_MODEL_FILE).write_text('{"costs": {}}')
    with pytest.raises(DflashTrtError, match="not a cost model"):
        CostModel.read(tmp_path)
    assert CostModel.read(tmp_path / "missing") is None


def test_adaptive_engine_output_equals_fixed(engine):
    from dflash_trt.engines.base import SamplingParams, collect

    ids = engine.tokenize("The quick brown fox", chat=True)
    params = SamplingParams(max_new_tokens=32)
    fixed = collect(engine.stream(ids, params))
    engine.cost_model = measure(engine, context_tokens=16, repeats=2)
    try:
        adaptive = collect(engine.stream(ids, params))
    finally:
        engine.cost_model = None
    assert adaptive.token_ids == fixed.token_ids
    assert adaptive.total_draft_tokens <= fixed.total_draft_tokens


def test_profile_measures_here_and_writes_the_cost_model(engine_dir):
    from dflash_trt.engines import load_engine

    (engine_dir / COST_MODEL_FILE).unlink(missing_ok=True)
    result = CliRunner().invoke(cli, ["profile", str(engine_dir), "--no-write"])
    assert result.exit_code == 0, result.output
    assert "target forward, 4 new tokens" in result.output
    assert not (engine_dir / COST_MODEL_FILE).exists()
    result = CliRunner().invoke(cli, ["profile", str(engine_dir), "--json"])
    assert result.exit_code == 0, result.output
    stored = CostModel.read(engine_dir)
    assert stored is not None and stored.identity() == device_identity("cpu", "float32")
    assert load_engine(engine_dir).cost_model == stored  # the served engine uses it


def test_profile_refuses_an_engine_without_a_drafter(tmp_path):
    from dflash_trt.engines.spec import EngineSpec

    EngineSpec(backend="torch", target="target", drafter=None, dtype="float32", device="cpu",
               block_size=1, max_batch_size=1, max_seq_len=64, chat_template=False).write(tmp_path)
    result = CliRunner().invoke(cli, ["profile", str(tmp_path)])
    assert result.exit_code == 2 and "with a drafter" in result.output


def test_online_costs_follow_what_the_batch_measures():
    from dflash_trt.dflash.draft_length import StepCosts
    from dflash_trt.engines.cost_model import OnlineCosts

    stored = CostModel(costs=StepCosts((0.10, 0.12, 0.14), 0.02), device="cpu", device_name="x",
                       dtype="float32", threads=1, torch_version="t",
                       batches={4: StepCosts((0.20, 0.30, 0.40), 0.04)})
    costs = OnlineCosts(stored)
    assert costs.verify_s(4, 2) == 0.30 and costs.step_s(4, 2) == pytest.approx(0.34)
    costs.record("verify", 4, 1, 0.10)  # one-token forwards run at half the stored time
    assert costs.verify_s(4, 1) == 0.10
    assert costs.verify_s(4, 3) == pytest.approx(0.20)  # unseen: scaled alike
    costs.record("verify", 4, 3, 0.40)  # measured: wide forwards are dearer than that
    assert costs.verify_s(4, 3) == 0.40
    costs.record("verify", 4, 3, 0.30)
    assert costs.verify_s(4, 3) == pytest.approx(0.40 + OnlineCosts.RATE * (0.30 - 0.40))
    costs.record("draft", 4, 0, 0.01)
    assert costs.draft_s(4) == 0.01 and costs.draft_s(1) == 0.02
    assert costs.verify_s(1, 2) == 0.12  # other row counts keep the stored model


def test_a_batching_cpu_engine_measures_its_costs_off_the_loading_thread(engine_dir, tmp_path,
                                                                         monkeypatch):
    """The loading thread must not start an OpenMP team beside the scheduler's
    (engines.cpu_threads): a cost model measured at load runs on a thread of its own, with the
    engine's thread count; a batch-1 engine measures on the caller's thread."""
    import shutil
    import threading

    import torch

    from dflash_trt.engines import cost_model, load_engine
    from dflash_trt.engines.spec import EngineSpec

    root = tmp_path / "engine"
    shutil.copytree(engine_dir, root, ignore=shutil.ignore_patterns(COST_MODEL_FILE))
    seen = []
    real = cost_model.measure

    def measure_here(engine, **kwargs):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return real(engine, context_tokens=16, repeats=1)

    monkeypatch.setattr(cost_model, "measure", measure_here)
    threads = torch.get_num_threads()
    spec = EngineSpec.read(root)
    for rows in (2, 1):
        dataclasses.replace(spec, max_batch_size=rows).write(root)
        engine = load_engine(root)
        try:
            assert engine.cost_model is not None
        finally:
            engine.close()
    assert seen == [("dflash-apart", threads), (threading.current_thread().name, threads)]


def test_a_packed_forwards_mean_width_is_priced_between_the_whole_widths():
    """A packed forward of 6 tokens over 4 rows (mean width 1.5) costs between 4 rows of 1 and 4
    rows of 2 tokens; widths past the table keep its last value."""
    from dflash_trt.dflash.draft_length import StepCosts

    stored = CostModel(costs=StepCosts((0.10, 0.12, 0.14), 0.02), device="cpu", device_name="x",
                       dtype="float32", threads=1, torch_version="t",
                       batches={4: StepCosts((0.20, 0.30, 0.40), 0.04)})
    assert stored.verify_s(4, 1.5) == pytest.approx(0.25)
    assert stored.verify_s(4, 2.25) == pytest.approx(0.325)
    assert stored.verify_s(4, 3) == 0.40 and stored.verify_s(4, 3.5) == 0.40
    assert stored.verify_s(2, 1.5) == pytest.approx(0.11 + (0.25 - 0.11) / 3)  # rows 1..4 too
