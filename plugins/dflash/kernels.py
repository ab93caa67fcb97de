"""Triton kernels for the DFlash ops, with the same signatures and semantics as `reference.py`.

Used on CUDA by `ops.py`; on CPU they run only under Triton's interpreter (TRITON_INTERPRET=1, set
before this module is imported), which is how CI tests them. Every kernel accumulates in float32.

The interpreter cannot do arithmetic on bfloat16 values (it has no native bf16), so each kernel
casts what it loads to a "compute dtype" first: the input dtype on a GPU (tensor cores take bf16 and
fp16 as they are), float32 in the interpreter. Float32 inputs use IEEE dot products, not TF32, so
the fp32 path stays close to the reference.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

LOG2E = 1.4426950408889634


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _compute_dtype(dtype: torch.dtype):
    """Dtype that tile loads are cast to before tl.dot / arithmetic (see module docstring)."""
    if interpreting() or dtype == torch.float32:
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # "tf32" is ignored for 16-bit inputs


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(max(int(n), 1)))


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2  # interpreter: a couple of "SMs" so that small tests still exercise splits


# ---------------------------------------------------------------------------------------------
# kv_inject: fc GEMM, hidden_norm, then one fused K (k_norm + RoPE) and one V kernel per layer.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, y_ptr, M, N, K,
    sx_m, sx_k, sw_n, sw_k, sy_m, sy_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    CDT: tl.constexpr, PREC: tl.constexpr,
):
    # y[M, N] = x[M, K] @ w[N, K]^T (nn.Linear without bias)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * sx_m + kk[None, :] * sx_k,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)  # [BM, BK]
        w = tl.load(w_ptr + rn[None, :] * sw_n + kk[:, None] * sw_k,
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)  # [BK, BN]
        acc = tl.dot(x.to(CDT), w.to(CDT), acc, input_precision=PREC)
    tl.store(y_ptr + rm[:, None] * sy_m + rn[None, :] * sy_n, acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, sx, sy, eps, BLOCK: tl.constexpr):
    # one program per row: y = x * rsqrt(mean(x^2) + eps) * w
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * sy + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _kv_proj_kernel(
    h_ptr, w_ptr, norm_ptr, cos_ptr, sin_ptr, out_ptr,
    T, H, HALF, eps,
    sh_t, sw_n, s_cos, s_sin, so_h, so_t,
    IS_KEY: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_K: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr,
):
    # One (token tile, kv head): out[head, t, :] = proj(h[t]) for that head's D = 2*HALF rows.
    # The two halves of the head are accumulated separately so that RoPE's rotate_half is a
    # register-level combination of the two accumulators, no shuffle needed.
    head = tl.program_id(1)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_HALF)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < T
    d_ok = rd < HALF
    rows1 = head * 2 * HALF + rd  # weight rows of the first half of this head
    acc1 = tl.zeros((BLOCK_M, BLOCK_HALF), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_HALF), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < H
        x = tl.load(h_ptr + rm[:, None] * sh_t + kk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(CDT)  # [BM, BK]
        w_mask = d_ok[None, :] & k_ok[:, None]
        w1 = tl.load(w_ptr + rows1[None, :] * sw_n + kk[:, None], mask=w_mask, other=0.0)  # [BK, BH]
        w2 = tl.load(w_ptr + (rows1 + HALF)[None, :] * sw_n + kk[:, None], mask=w_mask, other=0.0)
        acc1 = tl.dot(x, w1.to(CDT), acc1, input_precision=PREC)
        acc2 = tl.dot(x, w2.to(CDT), acc2, input_precision=PREC)
    if IS_KEY:
        # k_norm over the whole head (padding columns are zero), then RoPE at absolute positions.
        rstd = tl.rsqrt(tl.sum(acc1 * acc1 + acc2 * acc2, axis=1) / (2 * HALF) + eps)  # [BM]
        n1 = tl.load(norm_ptr + rd, mask=d_ok, other=0.0).to(tl.float32)
        n2 = tl.load(norm_ptr + HALF + rd, mask=d_ok, other=0.0).to(tl.float32)
        k1 = acc1 * rstd[:, None] * n1[None, :]  # [BM, BH]
        k2 = acc2 * rstd[:, None] * n2[None, :]
        tab_mask = m_ok[:, None] & d_ok[None, :]
        c1 = tl.load(cos_ptr + rm[:, None] * s_cos + rd[None, :], mask=tab_mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + rm[:, None] * s_cos + HALF + rd[None, :], mask=tab_mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + rm[:, None] * s_sin + rd[None, :], mask=tab_mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + rm[:, None] * s_sin + HALF + rd[None, :], mask=tab_mask, other=0.0).to(tl.float32)
        out1 = k1 * c1 - k2 * s1
        out2 = k2 * c2 + k1 * s2
    else:
        out1 = acc1
        out2 = acc2
    o = out_ptr + head * so_h + rm[:, None] * so_t + rd[None, :]
    o_mask = m_ok[:, None] & d_ok[None, :]
    tl.store(o, out1.to(out_ptr.dtype.element_ty), mask=o_mask)
    tl.store(o + HALF, out2.to(out_ptr.dtype.element_ty), mask=o_mask)


def _linear(x: Tensor, weight: Tensor) -> Tensor:
    """x [M, K] @ weight[N, K]^T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if interpreting():
        bm, bn, bk, warps, stages = _pow2(min(m, 32)), _pow2(min(n, 32)), _pow2(min(k, 32)), 4, 1
    elif m <= 64:  # decode-sized: skinny GEMM, memory bound, favour more programs over N
        bm, bn, bk, warps, stages = _pow2(m), 32, 128, 4, 4
    else:
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _linear_kernel[grid](
        x, weight, y, m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), y.stride(0), y.stride(1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, CDT=_compute_dtype(x.dtype), PREC=_precision(x.dtype),
        num_warps=warps, num_stages=stages,
    )
    return y


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    y = torch.empty_like(x)
    n = x.shape[-1]
    _rms_norm_kernel[(x.shape[0],)](
        x, weight, y, n, x.stride(0), y.stride(0), eps,
        BLOCK=_pow2(n), num_warps=8 if n >= 2048 else 4,
    )
    return y


def kv_inject(
    features: Tensor,
    fc_weight: Tensor,
    hidden_norm_weight: Tensor,
    k_proj_weights: list[Tensor],
    v_proj_weights: list[Tensor],
    k_norm_weights: list[Tensor],
    cos: Tensor,
    sin: Tensor,
    eps: float,
) -> Tensor:
    """Triton version of reference.kv_inject; returns kv [L, 2, Hkv, T, D]."""
    num_tokens = features.shape[0]
    head_dim = k_norm_weights[0].shape[0]
    num_kv_heads = k_proj_weights[0].shape[0] // head_dim
    kv = torch.empty((len(k_proj_weights), 2, num_kv_heads, num_tokens, head_dim),
                     dtype=features.dtype, device=features.device)  # [L, 2, Hkv, T, D]
    if num_tokens == 0:
        return kv
    features = features.contiguous() if features.stride(-1) != 1 else features
    hidden = _rms_norm(_linear(features, fc_weight.contiguous()), hidden_norm_weight, eps)  # [T, H]
    cos, sin = cos.contiguous(), sin.contiguous()
    half = head_dim // 2
    if interpreting():
        bm, bk, warps, stages = _pow2(min(num_tokens, 32)), _pow2(min(hidden.shape[1], 32)), 4, 1
    else:
        bm, bk, warps, stages = (16 if num_tokens <= 16 else 64), 64, 4, 3
    grid = (triton.cdiv(num_tokens, bm), num_kv_heads)
    layers = zip(k_proj_weights, v_proj_weights, k_norm_weights, strict=True)
    for layer, (w_k, w_v, w_norm) in enumerate(layers):
        for is_key, weight in ((True, w_k.contiguous()), (False, w_v.contiguous())):
            out = kv[layer, 0 if is_key else 1]  # [Hkv, T, D]
            _kv_proj_kernel[grid](
                hidden, weight, w_norm, cos, sin, out,
                num_tokens, hidden.shape[1], half, eps,
                hidden.stride(0), weight.stride(0), cos.stride(0), sin.stride(0),
                out.stride(0), out.stride(1),
                IS_KEY=is_key, BLOCK_M=bm, BLOCK_HALF=_pow2(half), BLOCK_K=bk,
                CDT=_compute_dtype(features.dtype), PREC=_precision(features.dtype),
                num_warps=warps, num_stages=stages,
            )
    return kv


# ---------------------------------------------------------------------------------------------
# block_draft_attention: split-K (flash-decoding style) over [visible context | block] keys.
# All G*B query rows of one kv head share a program, so each K/V tile is loaded once per group.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _block_attn_kernel(
    q_ptr, kc_ptr, vc_ptr, kb_ptr, vb_ptr, o_ptr, part_ptr, ml_ptr,
    B, D, ctx_start, num_vis, num_keys, chunk, qk_scale,
    sq_h, sq_b, skc_h, skc_t, svc_h, svc_t, skb_h, skb_b, svb_h, svb_b, so_h, so_b,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, CDT: tl.constexpr, PREC: tl.constexpr,
):
    kv_head = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # over GROUP * B query rows
    row_ok = rows < GROUP * B
    head = kv_head * GROUP + rows // B  # [BM] query head
    qi = rows % B  # [BM] position in the block
    rd = tl.arange(0, BLOCK_D)
    d_ok = rd < D
    q = tl.load(q_ptr + head[:, None] * sq_h + qi[:, None] * sq_b + rd[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(CDT)  # [BM, BD]
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    start = split * chunk
    end = tl.minimum(start + chunk, num_keys)
    for n0 in range(start, end, BLOCK_N):
        # Virtual key index n: n < num_vis -> context position ctx_start + n, else block n - num_vis.
        cols = n0 + tl.arange(0, BLOCK_N)
        valid = cols < end
        in_ctx = cols < num_vis
        in_blk = valid & (cols >= num_vis)
        ctx_t = ctx_start + cols
        blk_t = cols - num_vis
        kt_ctx = tl.load(kc_ptr + kv_head * skc_h + ctx_t[None, :] * skc_t + rd[:, None],
                         mask=in_ctx[None, :] & d_ok[:, None], other=0.0).to(CDT)  # [BD, BN]
        kt_blk = tl.load(kb_ptr + kv_head * skb_h + blk_t[None, :] * skb_b + rd[:, None],
                         mask=in_blk[None, :] & d_ok[:, None], other=0.0).to(CDT)
        kt = tl.where(in_ctx[None, :], kt_ctx, kt_blk)  # [BD, BN]
        s = tl.dot(q, kt, input_precision=PREC) * qk_scale  # [BM, BN], log2 units
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: every tile has a valid key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BM, BN]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_ctx = tl.load(vc_ptr + kv_head * svc_h + ctx_t[:, None] * svc_t + rd[None, :],
                        mask=in_ctx[:, None] & d_ok[None, :], other=0.0).to(CDT)  # [BN, BD]
        v_blk = tl.load(vb_ptr + kv_head * svb_h + blk_t[:, None] * svb_b + rd[None, :],
                        mask=in_blk[:, None] & d_ok[None, :], other=0.0).to(CDT)
        v = tl.where(in_ctx[:, None], v_ctx, v_blk)  # [BN, BD]
        acc = acc * alpha[:, None] + tl.dot(p.to(CDT), v, input_precision=PREC)
        m_i = m_new
    if SPLIT:
        # Partial results, combined by _attn_combine_kernel: acc unnormalised, (m, l) per row.
        out_row = head * B + qi  # [BM]
        num_rows = B * GROUP * tl.num_programs(0)
        part = part_ptr + (split * num_rows + out_row[:, None]) * BLOCK_D + rd[None, :]
        tl.store(part, acc, mask=row_ok[:, None])
        tl.store(ml_ptr + (split * num_rows + out_row) * 2, m_i, mask=row_ok)
        tl.store(ml_ptr + (split * num_rows + out_row) * 2 + 1, l_i, mask=row_ok)
    else:
        out = acc / l_i[:, None]
        tl.store(o_ptr + head[:, None] * so_h + qi[:, None] * so_b + rd[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _attn_combine_kernel(part_ptr, ml_ptr, o_ptr, B, D, num_rows, num_splits, so_h, so_b,
                         BLOCK_D: tl.constexpr):
    # One query row: merge the splits' (acc, m, l) with log-sum-exp weights.
    row = tl.program_id(0)
    rd = tl.arange(0, BLOCK_D)
    m = tl.full((), float("-inf"), dtype=tl.float32)
    for s in range(0, num_splits):
        m = tl.maximum(m, tl.load(ml_ptr + (s * num_rows + row) * 2))
    total = tl.zeros((), dtype=tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for s in range(0, num_splits):
        weight = tl.exp2(tl.load(ml_ptr + (s * num_rows + row) * 2) - m)  # 0 for empty splits
        total += weight * tl.load(ml_ptr + (s * num_rows + row) * 2 + 1)
        acc += weight * tl.load(part_ptr + (s * num_rows + row) * BLOCK_D + rd)
    head = row // B
    qi = row % B
    tl.store(o_ptr + head * so_h + qi * so_b + rd, (acc / total).to(o_ptr.dtype.element_ty),
             mask=rd < D)


def block_draft_attention(
    q: Tensor,
    k_ctx: Tensor,
    v_ctx: Tensor,
    k_blk: Tensor,
    v_blk: Tensor,
    window: int = 0,
    num_splits: int | None = None,
) -> Tensor:
    """Triton version of reference.block_draft_attention; q [Hq, B, D] -> [Hq, B, D].

    Inputs may be strided views (e.g. a slice of a preallocated cache) as long as the head_dim
    axis is contiguous. num_splits overrides the split-K heuristic (tests use it).
    """
    num_q_heads, block, head_dim = q.shape
    num_kv_heads, num_ctx = k_ctx.shape[0], k_ctx.shape[1]
    group = num_q_heads // num_kv_heads
    num_vis = min(num_ctx, window) if window > 0 else num_ctx
    num_keys = num_vis + block
    tensors = [t if t.stride(-1) == 1 else t.contiguous() for t in (q, k_ctx, v_ctx, k_blk, v_blk)]
    q, k_ctx, v_ctx, k_blk, v_blk = tensors
    out = torch.empty_like(q)
    rows = group * block
    block_m = _pow2(min(rows, 64))
    block_n = 32 if interpreting() else 64
    block_d = _pow2(head_dim)
    m_tiles = triton.cdiv(rows, block_m)
    if num_splits is None:
        wanted = max(1, (2 * _num_sms(q.device)) // (num_kv_heads * m_tiles))
        num_splits = min(wanted, triton.cdiv(num_keys, block_n))
    chunk = triton.cdiv(triton.cdiv(num_keys, num_splits), block_n) * block_n
    num_splits = triton.cdiv(num_keys, chunk)  # every split non-empty
    split = num_splits > 1
    part = ml = out  # placeholders, unused without SPLIT
    if split:
        part = torch.empty((num_splits, num_q_heads * block, block_d), dtype=torch.float32,
                           device=q.device)
        ml = torch.empty((num_splits, num_q_heads * block, 2), dtype=torch.float32, device=q.device)
    _block_attn_kernel[(num_kv_heads, num_splits, m_tiles)](
        q, k_ctx, v_ctx, k_blk, v_blk, out, part, ml,
        block, head_dim, num_ctx - num_vis, num_vis, num_keys, chunk,
        LOG2E / math.sqrt(head_dim),
        q.stride(0), q.stride(1), k_ctx.stride(0), k_ctx.stride(1), v_ctx.stride(0),
        v_ctx.stride(1), k_blk.stride(0), k_blk.stride(1), v_blk.stride(0), v_blk.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, SPLIT=split,
        CDT=_compute_dtype(q.dtype), PREC=_precision(q.dtype),
        num_warps=4, num_stages=1 if interpreting() else 2,
    )
    if split:
        _attn_combine_kernel[(num_q_heads * block,)](
            part, ml, out, block, head_dim, num_q_heads * block, num_splits,
            out.stride(0), out.stride(1), BLOCK_D=block_d, num_warps=1,
        )
    return out


# ---------------------------------------------------------------------------------------------
# accept: greedy (row argmax, then first mismatch) and rejection sampling (one program per block).
# ---------------------------------------------------------------------------------------------


@triton.jit
def _argmax_kernel(x_ptr, out_ptr, V, sx, BLOCK_V: tl.constexpr):
    # First index of the row maximum, like torch.argmax.
    row = tl.program_id(0)
    best_val = tl.full((), float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros((), dtype=tl.int32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(x_ptr + row * sx + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        tile_max = tl.max(x, axis=0)
        tile_idx = tl.argmax(x, axis=0, tie_break_left=True).to(tl.int32) + v0
        better = tile_max > best_val  # strict: an earlier tile wins ties
        best_idx = tl.where(better, tile_idx, best_idx)
        best_val = tl.where(better, tile_max, best_val)
    tl.store(out_ptr + row, best_idx.to(tl.int64))


@triton.jit
def _greedy_accept_kernel(draft_ptr, best_ptr, n_ptr, next_ptr, G, sd, sb,
                          BLOCK_G: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, BLOCK_G)
    j_ok = j < G
    draft = tl.load(draft_ptr + row * sd + j, mask=j_ok, other=0)
    best = tl.load(best_ptr + row * sb + j, mask=j_ok, other=0)
    num_accepted = tl.min(tl.where(j_ok & (draft != best), j, G), axis=0)  # first mismatch
    tl.store(n_ptr + row, num_accepted.to(tl.int64))
    tl.store(next_ptr + row, tl.load(best_ptr + row * sb + num_accepted))


@triton.jit
def _sample_accept_kernel(
    draft_ptr, p_ptr, q_ptr, u_ptr, n_ptr, next_ptr, G, V,
    sd, sp_n, sp_j, sq_n, sq_j, su,
    BLOCK_G: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    # 1. Accept draft token x_j while u_j * q(x_j) < p(x_j); num_accepted = first rejection.
    j = tl.arange(0, BLOCK_G)
    j_ok = j < G
    x = tl.load(draft_ptr + row * sd + j, mask=j_ok, other=0)
    p_x = tl.load(p_ptr + row * sp_n + j * sp_j + x, mask=j_ok, other=0.0).to(tl.float32)
    q_x = tl.load(q_ptr + row * sq_n + j * sq_j + x, mask=j_ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + j, mask=j_ok, other=0.0).to(tl.float32)
    rejected = j_ok & ~(u * q_x < p_x)
    n = tl.min(tl.where(rejected, j, G), axis=0)
    # At n == G (all accepted) the draw is the bonus from p_target[G]: no q row to subtract.
    q_cols = tl.where(n < G, V, 0)
    u_last = tl.load(u_ptr + row * su + G).to(tl.float32)
    p_row = p_ptr + row * sp_n + n * sp_j
    q_row = q_ptr + row * sq_n + n * sq_j
    # 2. Mass of the residual max(0, p - q) (and of p, the fallback when the residual is empty).
    total_res = tl.zeros((), dtype=tl.float32)
    total_p = tl.zeros((), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = cols < V
        pv = tl.load(p_row + cols, mask=ok, other=0.0).to(tl.float32)
        qv = tl.load(q_row + cols, mask=cols < q_cols, other=0.0).to(tl.float32)
        total_res += tl.sum(tl.maximum(pv - qv, 0.0), axis=0)
        total_p += tl.sum(pv, axis=0)
    use_p = total_res <= 0.0
    threshold = u_last * tl.where(use_p, total_p, total_res)
    # 3. Inverse CDF: count positions whose running mass is <= threshold.
    count = tl.zeros((), dtype=tl.int32)
    last = tl.zeros((), dtype=tl.int32)
    running = tl.zeros((), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = cols < V
        pv = tl.load(p_row + cols, mask=ok, other=0.0).to(tl.float32)
        qv = tl.load(q_row + cols, mask=cols < q_cols, other=0.0).to(tl.float32)
        dist = tl.where(use_p, pv, tl.maximum(pv - qv, 0.0))  # [BV]
        cdf = tl.cumsum(dist, axis=0) + running
        count += tl.sum((ok & (cdf <= threshold)).to(tl.int32), axis=0)
        last = tl.maximum(last, tl.max(tl.where(ok & (dist > 0.0), cols, 0), axis=0))
        running += tl.sum(dist, axis=0)
    tl.store(n_ptr + row, n.to(tl.int64))
    tl.store(next_ptr + row, tl.minimum(count, last).to(tl.int64))


def accept(
    draft_tokens: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor | None = None,
    uniforms: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Triton version of reference.accept; returns (num_accepted [N], next_token [N]) int64."""
    num_blocks, num_draft = draft_tokens.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    draft_tokens = draft_tokens.contiguous()
    target_probs = target_probs if target_probs.stride(-1) == 1 else target_probs.contiguous()
    num_accepted = torch.empty(num_blocks, dtype=torch.int64, device=device)
    next_token = torch.empty(num_blocks, dtype=torch.int64, device=device)
    block_g = _pow2(num_draft + 1, floor=2)
    block_v = 256 if interpreting() else 2048
    if num_blocks == 0:
        return num_accepted, next_token
    if draft_probs is None:
        rows = target_probs.reshape(num_blocks * (num_draft + 1), vocab)  # [N*(g+1), V]
        best = torch.empty(rows.shape[0], dtype=torch.int64, device=device)
        _argmax_kernel[(rows.shape[0],)](rows, best, vocab, rows.stride(0), BLOCK_V=block_v,
                                         num_warps=8)
        best = best.view(num_blocks, num_draft + 1)
        _greedy_accept_kernel[(num_blocks,)](
            draft_tokens, best, num_accepted, next_token, num_draft,
            draft_tokens.stride(0), best.stride(0), BLOCK_G=block_g, num_warps=1,
        )
        return num_accepted, next_token
    if uniforms is None:
        raise ValueError("rejection-sampling acceptance needs uniforms [N, g+1]")
    draft_probs = draft_probs if draft_probs.stride(-1) == 1 else draft_probs.contiguous()
    uniforms = uniforms.contiguous()
    _sample_accept_kernel[(num_blocks,)](
        draft_tokens, target_probs, draft_probs, uniforms, num_accepted, next_token,
        num_draft, vocab, draft_tokens.stride(0), target_probs.stride(0), target_probs.stride(1),
        draft_probs.stride(0), draft_probs.stride(1), uniforms.stride(0),
        BLOCK_G=block_g, BLOCK_V=block_v, num_warps=8,
    )
    return num_accepted, next_token
