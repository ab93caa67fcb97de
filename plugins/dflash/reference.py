"""Golden pure-torch reference for the DFlash ops. Runs anywhere torch runs.

These functions define what the ops compute; the Triton kernels in `kernels.py` are checked against
them (see tolerances.yaml). They favour clarity over speed: attention and acceptance math is done in
float32 whatever the input dtype, and the result is cast back to the input dtype.

Shapes use T = new context tokens, B = block size, g = B - 1 draft tokens, N = blocks in a batch,
H = hidden size, k = number of target layers, L = drafter layers, Hq/Hkv = query/key-value heads,
D = head_dim, V = vocabulary size.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3RMSNorm: normalise in float32, cast back, then scale (same rounding as transformers)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim (the Llama/Qwen RoPE convention)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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
    """Context features -> every drafter layer's K/V for those context positions.

    features: [T, k*H] concatenated target hidden states; fc_weight: [H, k*H];
    hidden_norm_weight: [H]; per layer l: k_proj_weights[l], v_proj_weights[l]: [Hkv*D, H],
    k_norm_weights[l]: [D]; cos, sin: [T, D] rotary tables at the tokens' absolute positions.
    Returns kv: [L, 2, Hkv, T, D] (kv[l, 0] = keys, kv[l, 1] = values), ready to append to
    layer l's drafter cache along the T axis.
    """
    num_tokens = features.shape[0]
    head_dim = k_norm_weights[0].shape[0]
    hidden = features @ fc_weight.T  # [T, H]
    hidden = rms_norm(hidden, hidden_norm_weight, eps)  # [T, H]
    out = []
    for w_k, w_v, w_norm in zip(k_proj_weights, v_proj_weights, k_norm_weights, strict=True):
        k = (hidden @ w_k.T).view(num_tokens, -1, head_dim)  # [T, Hkv, D]
        k = rms_norm(k, w_norm, eps).transpose(0, 1)  # [Hkv, T, D]
        k = k * cos + rotate_half(k) * sin  # [Hkv, T, D]; cos/sin broadcast over heads
        v = (hidden @ w_v.T).view(num_tokens, -1, head_dim).transpose(0, 1)  # [Hkv, T, D]
        out.append(torch.stack((k, v)))  # [2, Hkv, T, D]
    return torch.stack(out)  # [L, 2, Hkv, T, D]


def block_draft_attention(
    q: Tensor,
    k_ctx: Tensor,
    v_ctx: Tensor,
    k_blk: Tensor,
    v_blk: Tensor,
    window: int = 0,
) -> Tensor:
    """Non-causal attention of a draft block over the cached context and the block itself.

    q: [Hq, B, D]; k_ctx, v_ctx: [Hkv, T, D] (the drafter cache, T may be 0);
    k_blk, v_blk: [Hkv, B, D]. Query head h reads key/value head h // (Hq // Hkv) (GQA).
    window > 0 keeps only the last `window` context positions visible; the block is always
    fully visible. Softmax scale 1/sqrt(D). Returns [Hq, B, D] in q's dtype.
    """
    num_ctx = k_ctx.shape[1]
    if 0 < window < num_ctx:
        k_ctx, v_ctx = k_ctx[:, num_ctx - window :], v_ctx[:, num_ctx - window :]
    group = q.shape[0] // k_ctx.shape[0]
    k = torch.cat((k_ctx, k_blk), dim=1).float().repeat_interleave(group, dim=0)  # [Hq, T'+B, D]
    v = torch.cat((v_ctx, v_blk), dim=1).float().repeat_interleave(group, dim=0)  # [Hq, T'+B, D]
    scores = (q.float() @ k.transpose(1, 2)) * q.shape[-1] ** -0.5  # [Hq, B, T'+B]
    return (scores.softmax(dim=-1) @ v).to(q.dtype)  # [Hq, B, D]


def accept(
    draft_tokens: Tensor,
    target_probs: Tensor,
    draft_probs: Tensor | None = None,
    uniforms: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Accept a prefix of each draft block and pick the next token.

    draft_tokens: [N, g] int64, the drafted tokens after each block's first token.
    target_probs: [N, g+1, V], the target's distribution at every block position (for greedy,
    logits work too: only the argmax is used).
    Greedy (draft_probs is None): accept the longest prefix where draft == target argmax; the
    next token is the target argmax right after it (the bonus token when all g are accepted).
    Sampling (draft_probs: [N, g, V], uniforms: [N, g+1] in [0, 1)): accept draft token x_j
    while uniforms[:, j] * p_draft(x_j) < p_target(x_j) (i.e. with prob min(1, p/q)); at the
    first rejection r draw from normalize(max(0, p_target[r] - p_draft[r])) (p_target[r] if that
    is all zero), or, when all are accepted, from p_target[g]. That draw is an inverse-CDF draw
    with uniforms[:, g]: the first index whose cumulative mass exceeds uniforms[:, g] * total.
    Returns (num_accepted [N] int64 in [0, g], next_token [N] int64).
    """
    num_draft = draft_tokens.shape[1]
    if draft_probs is None:
        best = target_probs.argmax(dim=-1)  # [N, g+1]
        matched = (draft_tokens == best[:, :num_draft]).long().cumprod(dim=-1)  # [N, g]
        num_accepted = matched.sum(dim=-1)  # [N]
        return num_accepted, best.gather(1, num_accepted[:, None])[:, 0]
    if uniforms is None:
        raise ValueError("rejection-sampling acceptance needs uniforms [N, g+1]")
    p = target_probs.float()  # [N, g+1, V]
    q = torch.cat((draft_probs.float(), torch.zeros_like(p[:, :1])), dim=1)  # [N, g+1, V]
    p_x = p[:, :num_draft].gather(-1, draft_tokens[..., None])[..., 0]  # [N, g]
    q_x = q[:, :num_draft].gather(-1, draft_tokens[..., None])[..., 0]  # [N, g]
    kept = (uniforms[:, :num_draft].float() * q_x < p_x).long().cumprod(dim=-1)  # [N, g]
    num_accepted = kept.sum(dim=-1)  # [N]
    # Position g has q = 0, so "residual" there is p_target itself: the bonus draw.
    at = num_accepted[:, None, None].expand(-1, 1, p.shape[-1])  # [N, 1, V]
    p_at = p.gather(1, at)[:, 0]  # [N, V]
    residual = (p_at - q.gather(1, at)[:, 0]).clamp_min(0)  # [N, V]
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # [N, 1]
    dist = torch.where(empty, p_at, residual)  # [N, V]
    return num_accepted, inverse_cdf(dist, uniforms[:, num_draft].float())


def inverse_cdf(dist: Tensor, u: Tensor) -> Tensor:
    """Draw index i from unnormalised dist [N, V] with u [N] in [0, 1): first i with cdf > u*total.

    Never returns an index of zero mass: rounding can leave u*total at or past the last cumulative
    value, so the result is clamped to the last index with mass.
    """
    cdf = dist.cumsum(dim=-1)  # [N, V]
    threshold = u * cdf[:, -1]  # [N]
    index = (cdf <= threshold[:, None]).sum(dim=-1)  # [N]
    positions = torch.arange(dist.shape[-1], device=dist.device)
    last = torch.where(dist > 0, positions, -1).amax(dim=-1).clamp_min(0)  # [N]
    return torch.minimum(index, last)
