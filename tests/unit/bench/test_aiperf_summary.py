"""scripts/aiperf_summary.py: the c<N> / c1 ratios and medians read from AIPerf's exports."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "aiperf_summary.py"


def _module():
    spec = importlib.util.spec_from_file_location("aiperf_summary", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _export(path: Path, tok_s: float, ttft_p50: float, errors=()) -> None:
    path.mkdir(parents=True)
    (path / "profile_export_aiperf.json").write_text(json.dumps({
        "output_token_throughput": {"unit": "tokens/sec", "avg": tok_s},
        "time_to_first_token": {"unit": "ms", "avg": ttft_p50 + 5, "p50": ttft_p50},
        "request_count": {"unit": "requests", "avg": 32.0},
        "error_summary": list(errors)}))


def test_repeats_give_per_repeat_ratios_and_their_median(tmp_path):
    for i, (c1, c4, f1, f4) in enumerate([(50, 100, 80, 160), (40, 120, 80, 120),
                                          (60, 150, 100, 100)], 1):
        _export(tmp_path / f"r{i}" / "c1", c1, f1)
        _export(tmp_path / f"r{i}" / "c4", c4, f4)
    module = _module()
    table = module.summary(module.read_runs(tmp_path))
    rows = table.splitlines()
    assert "| 1 | 50.0, 80 | 100.0, 160 | 2.00x, 2.00x | 0 (32/32 requests) |" in rows
    assert "| 2 | 40.0, 80 | 120.0, 120 | 3.00x, 1.50x | 0 (32/32 requests) |" in rows
    # medians of each column and of the per-repeat ratios (not a ratio of medians: 120 / 50)
    assert rows[-1] == "| median | 50.0, 80 | 120.0, 120 | **2.50x**, 1.50x | |"


def test_one_run_and_its_errors(tmp_path):
    _export(tmp_path / "c1", 50, 80)
    _export(tmp_path / "c4", 125, 90, errors=[{"error": "x", "count": 3}])
    module = _module()
    rows = module.summary(module.read_runs(tmp_path)).splitlines()
    assert rows[2] == "| 1 | 50.0, 80 | 125.0, 90 | 2.50x, 1.12x | 3 (32/32 requests) |"


def test_an_empty_directory_says_what_to_run(tmp_path):
    with pytest.raises(SystemExit, match="aiperf_cpu.sh"):
        _module().read_runs(tmp_path)
