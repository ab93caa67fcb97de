"""Outputs are identical, diverge at a tie of the dtype, or mismatch."""

from __future__ import annotations

import torch

from dflash_trt.engines.base import TIE_ULPS, classify_outputs, tie_bound


def test_tie_bound_is_units_in_the_last_place_of_the_dtype():
    # bf16 near 20 (in [16, 32)): one unit in the last place is 2**(4 - 7) = 0.125
    assert tie_bound("bfloat16", 20.0) == TIE_ULPS * 0.125
    assert tie_bound("bfloat16", -20.0) == TIE_ULPS * 0.125
    assert tie_bound("float16", 20.0) == TIE_ULPS * 2.0 ** (4 - 10)
    assert tie_bound("float32", 20.0) is None and tie_bound("float64", 1.0) is None


def _logits(values: dict[int, float]):
    row = torch.full((8,), -5.0)
    for token, value in values.items():
        row[token] = value
    return lambda i: row


def test_identical_outputs_need_no_logits():
    def no_logits(i):
        raise AssertionError("not asked for")

    assert classify_outputs([1, 2], [1, 2], "bfloat16", no_logits)["status"] == "identical"


def test_a_bf16_divergence_within_the_bound_is_a_near_tie_and_beyond_it_a_mismatch():
    tie = classify_outputs([1, 3], [1, 4], "bfloat16", _logits({3: 20.0, 4: 19.75}))
    assert tie["status"] == "near-tie" and tie["first_difference"] == 1
    assert tie["logit_gap"] == 0.25 and tie["tie_bound"] == 0.5
    far = classify_outputs([1, 3], [1, 4], "bfloat16", _logits({3: 20.0, 4: 19.0}))
    assert far["status"] == "mismatch" and far["logit_gap"] == 1.0


def test_float32_has_no_ties_and_a_length_difference_is_a_mismatch():
    assert classify_outputs([3], [4], "float32", _logits({3: 1.0, 4: 1.0}))["status"] == "mismatch"
    assert classify_outputs([3, 5], [3], "bfloat16", _logits({}))["status"] == "mismatch"
