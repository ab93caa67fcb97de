"""The DFlash Triton kernels against the torch reference, at tiny random shapes.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set here before the
kernels are first imported), so CI checks the real kernel code, not a stand-in.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton-lang is not installed (pip install 'triton>=3.4')", allow_module_level=True)
if not torch.cuda.is_available():
    # Must precede the first `import triton` anywhere: Triton picks interpreted or compiled
    # functions when it is imported.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET=1 was set; rerun with "
                    "TRITON_INTERPRET=1 in the environment", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"

from dflash_trt.plugins import load_dflash_ops  # noqa: E402

ops = load_dflash_ops()
kernels = importlib.import_module(f"{ops.__name__}.kernels")
cases = importlib.import_module(f"{ops.__name__}.cases")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def shape(hq=4, hkv=2, d=16, hidden=32, layers=2, k=2, block=4, vocab=64):
    return cases.DrafterShape(hidden=hidden, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                              num_layers=layers, num_target_layers=k, block_size=block, vocab=vocab)


def assert_close(op, got, want):
    result = cases.compare(op, got, want)
    assert result.ok, result


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "start", "dims"), [
    (1, 0, shape()),
    (7, 13, shape(hkv=1, d=32, hidden=48, k=3)),  # odd lengths, non-power-of-two hidden
    (19, 101, shape(hkv=3, d=24, hidden=40, layers=1)),  # head_dim not a power of two
])
def test_kv_inject_matches_reference(dtype, num_tokens, start, dims):
    args = cases.kv_inject_inputs(dims, num_tokens, start, dtype, DEVICE, seed=num_tokens)
    want = ops.reference.kv_inject(*args)
    got = kernels.kv_inject(*args)
    assert got.shape == (dims.num_layers, 2, dims.num_kv_heads, num_tokens, dims.head_dim)
    assert_close("kv_inject", got, want)


def test_kv_inject_detects_a_wrong_position():
    """The tolerance is tight enough to see RoPE at the wrong absolute position."""
    dims = shape()
    args = list(cases.kv_inject_inputs(dims, 5, 40, torch.float32, DEVICE))
    want = ops.reference.kv_inject(*args)
    args[6], args[7] = cases.rope_tables(torch.arange(41, 46), dims.head_dim)
    assert not cases.compare("kv_inject", kernels.kv_inject(*args), want).ok


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_ctx", "window", "splits", "dims"), [
    (37, 0, None, shape()),  # GQA 2, split-K by heuristic
    (37, 10, 3, shape(hq=6, hkv=2, block=5)),  # GQA 3, odd block, sliding window, 3 splits
    (0, 0, None, shape(hq=4, hkv=4, block=3)),  # no context yet, MHA
    (70, 90, 1, shape(hq=8, hkv=1, d=24, block=7)),  # MQA, window wider than the context
])
def test_block_draft_attention_matches_reference(dtype, num_ctx, window, splits, dims):
    args = cases.attention_inputs(dims, num_ctx, dtype, DEVICE, seed=num_ctx)
    want = ops.reference.block_draft_attention(*args, window)
    got = kernels.block_draft_attention(*args, window, num_splits=splits)
    assert_close("block_draft_attention", got, want)


def test_block_draft_attention_reads_strided_cache_views():
    """The drafter cache may be a prefix view of a preallocated buffer."""
    dims = shape()
    q, k_ctx, v_ctx, k_blk, v_blk = cases.attention_inputs(dims, 40, torch.float32, DEVICE)
    k_buf = torch.zeros(2, 64, 16, device=DEVICE)
    v_buf = torch.zeros(2, 64, 16, device=DEVICE)
    k_buf[:, :23], v_buf[:, :23] = k_ctx[:, :23], v_ctx[:, :23]
    want = ops.reference.block_draft_attention(q, k_ctx[:, :23], v_ctx[:, :23], k_blk, v_blk)
    got = kernels.block_draft_attention(q, k_buf[:, :23], v_buf[:, :23], k_blk, v_blk)
    assert_close("block_draft_attention", got, want)


def test_block_draft_attention_window_changes_the_output():
    dims = shape()
    args = cases.attention_inputs(dims, 30, torch.float32, DEVICE)
    full = kernels.block_draft_attention(*args, 0)
    windowed = kernels.block_draft_attention(*args, 8)
    assert not cases.compare("block_draft_attention", windowed, full).ok


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_blocks", "num_draft", "vocab"), [(5, 3, 300), (3, 6, 1000)])
def test_accept_matches_reference(dtype, num_blocks, num_draft, vocab):
    tokens, p, q, u = cases.accept_inputs(num_blocks, num_draft, vocab, dtype, DEVICE, seed=vocab)
    want_n, want_next = ops.reference.accept(tokens, p, q, u)
    got_n, got_next = kernels.accept(tokens, p, q, u)
    assert torch.equal(got_n, want_n) and torch.equal(got_next, want_next)
    # Greedy: plant the target's argmax as the first drafts so that every length shows up.
    best = p.argmax(-1)  # [N, g+1]
    planted = tokens.clone()
    for row in range(num_blocks):
        keep = row % (num_draft + 1)
        planted[row, :keep] = best[row, :keep]
        if keep < num_draft:
            planted[row, keep] = (best[row, keep] + 1) % vocab
    want_n, want_next = ops.reference.accept(planted, p)
    got_n, got_next = kernels.accept(planted, p)
    assert want_n.tolist() == [row % (num_draft + 1) for row in range(num_blocks)]
    assert torch.equal(got_n, want_n) and torch.equal(got_next, want_next)


def test_accept_bonus_and_empty_residual():
    """All accepted -> bonus drawn from p_target[g]; p == q at a rejection -> draw from p."""
    vocab = 40
    p = torch.zeros(2, 3, vocab, device=DEVICE)
    p[:, :, 7] = 1.0
    p[1, 2] = 0.0
    p[1, 2, 11] = 1.0
    q = p[:, :2].clone()
    tokens = torch.full((2, 2), 7, device=DEVICE)
    tokens[1, 1] = 9  # q(9) = 0 and p(9) = 0: never accepted
    u = torch.full((2, 3), 0.5, device=DEVICE)
    got = kernels.accept(tokens, p, q, u)
    want = ops.reference.accept(tokens, p, q, u)
    assert got[0].tolist() == want[0].tolist() == [2, 1]
    assert got[1].tolist() == want[1].tolist() == [7, 7]
