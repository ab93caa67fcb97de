"""The acceptance profile: per-position curve over reached drafts, and calibration bins."""

from __future__ import annotations

import pytest

from dflash_trt.dflash.acceptance import acceptance_profile, plot_profile, profile_lines


def test_position_curve_counts_only_reached_drafts():
    steps = [((0.9, 0.8, 0.2), 2),  # drafts 1, 2 accepted, 3 rejected
             ((0.9, 0.1, 0.1), 0),  # draft 1 rejected: 2 and 3 never reached
             ((), 0),               # no drafter (plain or lookup step): ignored
             ((0.95, 0.85, 0.75), 3)]  # all accepted
    profile = acceptance_profile(steps)
    assert profile["drafter_steps"] == 3
    curve = [(p["position"], p["reached"], p["accepted"]) for p in profile["position_acceptance"]]
    assert curve == [(1, 3, 2), (2, 2, 2), (3, 2, 1)]


def test_calibration_bins_and_error():
    steps = [((0.95,), 1), ((0.95,), 1), ((0.15,), 0), ((0.15,), 1)]
    profile = acceptance_profile(steps, bins=10)
    bins = {(c["confidence_from"], c["drafts"], c["accepted"]) for c in profile["calibration"]}
    assert bins == {(0.9, 2, 2), (0.1, 2, 1)}
    # |1.0 - 0.95| * 2 + |0.5 - 0.15| * 2, over 4 drafts
    assert profile["expected_calibration_error"] == pytest.approx((0.05 * 2 + 0.35 * 2) / 4)
    assert "1:0.75" in profile_lines(profile)[0]


def test_confidence_one_falls_in_the_top_bin_and_empty_input_is_empty():
    assert acceptance_profile([((1.0,), 1)])["calibration"][0]["confidence_from"] == 0.9
    empty = acceptance_profile([])
    assert empty["position_acceptance"] == [] and empty["expected_calibration_error"] == 0.0


def test_plot_writes_a_png(tmp_path):
    plot_profile(acceptance_profile([((0.9, 0.5), 1), ((0.3,), 0)]), tmp_path / "p.png", "t")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_calibration_points_keep_the_well_filled_bins():
    from dflash_trt.dflash.acceptance import calibration_points

    steps = [((0.95,), 0)] * 30 + [((0.55,), 1)] * 5
    points = calibration_points(acceptance_profile(steps))
    assert points == [[pytest.approx(0.95), 0.0]]  # the 0.5 bin has 5 drafts: left out


def test_calibrated_interpolates_and_is_flat_beyond_the_points():
    from dflash_trt.dflash.acceptance import calibrated

    curve = calibrated([[0.9, 0.5], [0.3, 0.1]])
    assert curve(0.3) == pytest.approx(0.1) and curve(0.6) == pytest.approx(0.3)
    assert curve(0.0) == pytest.approx(0.1) and curve(1.0) == pytest.approx(0.5)
    assert calibrated([]) is None


def test_read_calibration_takes_reports_and_engine_files(tmp_path):
    import json

    from dflash_trt.dflash.acceptance import read_calibration
    from dflash_trt.errors import UsageError

    report = tmp_path / "eval.json"
    report.write_text(json.dumps({"acceptance_profile": acceptance_profile([((0.95,), 1)] * 25)}))
    assert read_calibration(report) == [[pytest.approx(0.95), 1.0]]
    engine_file = tmp_path / "acceptance_calibration.json"
    engine_file.write_text(json.dumps({"points": [[0.5, 0.2]]}))
    assert read_calibration(engine_file) == [[0.5, 0.2]]
    thin = tmp_path / "thin.json"
    thin.write_text(json.dumps({"acceptance_profile": acceptance_profile([((0.95,), 1)] * 3)}))
    with pytest.raises(UsageError, match="no calibration bin has 20"):
        read_calibration(thin)
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(UsageError, match="no acceptance_profile"):
        read_calibration(tmp_path / "other.json")


def test_bench_offline_calibration_needs_adaptive(tmp_path):
    from click.testing import CliRunner

    from dflash_trt.commands.bench import bench_offline_command

    report = tmp_path / "eval.json"
    report.write_text('{"points": [[0.5, 0.2]]}')
    result = CliRunner().invoke(bench_offline_command, [
        "--target", "nowhere", "--drafter", str(tmp_path), "--prompts", "builtin:chat",
        "--calibration", str(report)])
    assert result.exit_code == 2 and "add --adaptive" in result.output
