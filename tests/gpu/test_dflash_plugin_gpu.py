"""The DFlash Triton kernels against the reference at Qwen3-8B drafter sizes (needs CUDA)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton-lang"),
]


def _checks_module():
    path = Path(__file__).with_name("run_gpu_checks.py")
    spec = importlib.util.spec_from_file_location("dflash_gpu_checks", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernels_match_reference_at_production_sizes():
    failures = [c for c in _checks_module().correctness_checks() if not c["ok"]]
    assert not failures, failures


def test_ops_dispatch_to_the_kernels_on_cuda():
    checks = _checks_module()
    args = checks.cases.attention_inputs(checks.SHAPE, 100, torch.bfloat16, "cuda")
    got = torch.ops.dflash.block_draft_attention(*args, 0)
    assert torch.equal(got, checks.kernels.block_draft_attention(*args, 0))
