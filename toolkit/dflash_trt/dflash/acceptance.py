"""The drafter's acceptance profile: where in a block drafts stop passing, and whether its
confidence says so in advance.

Input: the drafter's steps as (confidences of the verified drafts, drafts accepted). Drafts are
accepted as a prefix, so draft i is *reached* when drafts 1..i-1 were all accepted, and the
per-position curve is P(draft i accepted | draft i reached). Calibration bins every reached
draft by the drafter's confidence in it (the peak of its distribution at that position) and
compares the mean confidence with the share accepted; the adaptive draft length
(dflash.draft_length) trusts these confidences, so a badly calibrated drafter shows here first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

BINS = 10


def acceptance_profile(steps: Iterable[tuple[Sequence[float], int]], bins: int = BINS) -> dict:
    """{"position_acceptance": [...], "calibration": [...], "expected_calibration_error": x}."""
    reached: list[int] = []
    passed: list[int] = []
    cal = [[0, 0, 0.0] for _ in range(bins)]  # per bin: drafts reached, accepted, confidence sum
    num_steps = 0
    for confidences, accepted in steps:
        if not confidences:
            continue
        num_steps += 1
        for i, conf in enumerate(confidences[:accepted + 1]):  # the drafts reached
            while len(reached) <= i:
                reached.append(0)
                passed.append(0)
            hit = i < accepted
            reached[i] += 1
            passed[i] += hit
            b = cal[min(int(conf * bins), bins - 1)]
            b[0] += 1
            b[1] += hit
            b[2] += conf
    positions = [{"position": i + 1, "reached": r, "accepted": a, "rate": a / r}
                 for i, (r, a) in enumerate(zip(reached, passed, strict=True))]
    calibration = [{"confidence_from": k / bins, "confidence_to": (k + 1) / bins, "drafts": n,
                    "accepted": a, "rate": a / n, "mean_confidence": c / n}
                   for k, (n, a, c) in enumerate(cal) if n]
    total = sum(row["drafts"] for row in calibration)
    ece = sum(row["drafts"] * abs(row["rate"] - row["mean_confidence"])
              for row in calibration) / total if total else 0.0
    return {"drafter_steps": num_steps, "position_acceptance": positions,
            "calibration": calibration, "expected_calibration_error": ece}


def profile_lines(profile: dict) -> list[str]:
    """A few lines for a terminal or a markdown report."""
    curve = " ".join(f"{p['position']}:{p['rate']:.2f}" for p in profile["position_acceptance"])
    cal = " ".join(f"{c['mean_confidence']:.2f}->{c['rate']:.2f}" for c in profile["calibration"])
    return [f"P(draft i accepted | drafts before it accepted), over {profile['drafter_steps']} "
            f"drafter steps: {curve or 'no drafter steps'}",
            f"confidence -> acceptance, per bin: {cal or '-'} (expected calibration error "
            f"{profile['expected_calibration_error']:.3f})"]


def plot_profile(profile: dict, path, title: str = "") -> None:
    """A PNG: the per-position curve and the calibration (reliability) diagram side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    pos = profile["position_acceptance"]
    left.plot([p["position"] for p in pos], [p["rate"] for p in pos], marker="o")
    left.set(xlabel="draft position i", ylabel="P(accepted | reached)", ylim=(0, 1),
             title="acceptance by position")
    cal = profile["calibration"]
    right.plot([0, 1], [0, 1], linestyle=":", color="grey")
    right.scatter([c["mean_confidence"] for c in cal], [c["rate"] for c in cal],
                  s=[10 + 60 * c["drafts"] / max(1, max(x["drafts"] for x in cal)) for c in cal])
    right.set(xlabel="drafter confidence", ylabel="share accepted", xlim=(0, 1), ylim=(0, 1),
              title=f"calibration (ECE {profile['expected_calibration_error']:.3f})")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


MIN_BIN_DRAFTS = 20  # a calibration bin with fewer drafts says too little to trust


def calibration_points(profile: dict, min_drafts: int = MIN_BIN_DRAFTS) -> list[list[float]]:
    """[[mean confidence, share accepted], ...] of the bins with at least `min_drafts` drafts."""
    return [[c["mean_confidence"], c["rate"]] for c in profile.get("calibration", [])
            if c["drafts"] >= min_drafts]


def calibrated(points: Sequence[Sequence[float]]):
    """Confidence -> probability of acceptance: piecewise linear through the points, flat
    beyond them; None when there are none (use the raw confidence)."""
    if not points:
        return None
    xs, ys = zip(*sorted((float(x), float(y)) for x, y in points), strict=True)

    def acceptance(confidence: float) -> float:
        if confidence <= xs[0]:
            return ys[0]
        for x0, y0, x1, y1 in zip(xs, ys, xs[1:], ys[1:], strict=False):
            if confidence <= x1:
                return y0 + (y1 - y0) * (confidence - x0) / (x1 - x0) if x1 > x0 else y1
        return ys[-1]

    return acceptance


def read_calibration(path) -> list[list[float]]:
    """The calibration points of the acceptance profile in a JSON report (`eval --report`,
    reports/verify.json) or an engine's acceptance_calibration.json."""
    import json
    from pathlib import Path

    from dflash_trt.errors import UsageError

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: not a JSON report ({exc})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a JSON object (a report), got {type(data).__name__}")
    if "points" in data:
        return [list(p) for p in data["points"]]
    profile = data.get("acceptance_profile")
    if not isinstance(profile, dict):
        raise UsageError(f"{path}: no acceptance_profile; give an `eval --report` file or a "
                         "build's reports/verify.json")
    points = calibration_points(profile)
    if not points:
        raise UsageError(f"{path}: no calibration bin has {MIN_BIN_DRAFTS}+ drafts; measure on "
                         "more prompts")
    return points
