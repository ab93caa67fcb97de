"""The shipped drafter data holds no evaluation prompt (HumanEval, builtin:chat): every file passes
the training guard, so none of them can reach training through `train-drafter --data`."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from dflash_trt.training import corpus

DATA = Path(__file__).resolve().parents[3] / "recipes" / "assets" / "smollm2-135m-dflash" / "data"
FILES = sorted(DATA.glob("*.jsonl.gz"))


def test_the_data_directory_ships_files():
    assert len(FILES) >= 8


@pytest.mark.parametrize("packed", FILES, ids=lambda p: p.name)
def test_a_shipped_data_file_passes_the_evaluation_guard(packed, tmp_path):
    plain = tmp_path / packed.name.removesuffix(".gz")
    plain.write_bytes(gzip.decompress(packed.read_bytes()))
    samples = corpus.load_samples([str(plain)])  # raises UsageError on an evaluation prompt
    assert samples and not any(corpus.holds_eval_prompt(s) for s in samples)
