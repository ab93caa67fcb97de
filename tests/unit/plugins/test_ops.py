"""Registration and dispatch of the DFlash torch.library ops, and the plugin loader."""

from __future__ import annotations

import importlib

import pytest
import torch

from dflash_trt.plugins import dflash_plugin_dir, load_dflash_ops

ops = load_dflash_ops()
cases = importlib.import_module(f"{ops.__name__}.cases")
DIMS = cases.DrafterShape(hidden=32, num_q_heads=4, num_kv_heads=2, head_dim=16, num_layers=2,
                          num_target_layers=2, block_size=4, vocab=50)


def test_loader_imports_the_checkout_plugin_once():
    assert dflash_plugin_dir() == ops.PLUGIN_DIR
    assert (ops.PLUGIN_DIR / "tolerances.yaml").is_file()
    assert load_dflash_ops() is ops


def test_ops_are_registered_under_the_dflash_namespace():
    for name in ("kv_inject", "block_draft_attention", "accept"):
        assert hasattr(torch.ops.dflash, name)


def test_cpu_runs_the_reference():
    assert ops.get_backend() in ops.BACKENDS
    args = cases.attention_inputs(DIMS, 9, torch.float32)
    got = torch.ops.dflash.block_draft_attention(*args, 4)
    torch.testing.assert_close(got, ops.reference.block_draft_attention(*args, 4), rtol=0, atol=0)


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="reference"):
        ops.set_backend("cuda-graphs")


def test_accept_draws_uniforms_from_the_generator():
    tokens, p, q, _ = cases.accept_inputs(4, 3, 30, torch.float32)
    first = ops.accept(tokens, p, q, generator=torch.Generator().manual_seed(5))
    again = ops.accept(tokens, p, q, generator=torch.Generator().manual_seed(5))
    u = torch.rand(4, 4, generator=torch.Generator().manual_seed(5))
    explicit = ops.reference.accept(tokens, p, q, u)
    for a, b, c in zip(first, again, explicit, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("name", ["kv_inject", "block_draft_attention", "accept"])
def test_opcheck(name):
    """Schema, fake (meta) implementation and dispatcher registration are consistent."""
    if name == "kv_inject":
        args = cases.kv_inject_inputs(DIMS, 3, 7, torch.float32)
    elif name == "block_draft_attention":
        args = (*cases.attention_inputs(DIMS, 5, torch.float32), 3)
    else:
        args = cases.accept_inputs(2, 3, DIMS.vocab, torch.float32)
    torch.library.opcheck(getattr(torch.ops.dflash, name).default, args,
                          test_utils=("test_schema", "test_faketensor"))
