"""The target's attention: row-wise in half precision (below), grouped-KV sdpa otherwise on CPU.

**gqa_sdpa** (float32, float64, on CPU). transformers' sdpa copies grouped key/value heads out to every
query head whenever it passes a mask, and a batch with rows of their own lengths always has one
(dflash.slots). torch's sdpa takes the groups as they are (`enable_gqa`) with a mask too: per
layer of SmolLM2 on this CPU, 8 rows x 300 keys took 0.3 ms instead of 3.0 ms, 4 x 160 0.13 ms
instead of 0.27. Same arithmetic otherwise (masks are built as for sdpa).

**rowwise_sdpa**: attention whose result for a query row does not depend on how many rows run
with it.

Speculative decoding is lossless only if a k-token verify forward computes, for each of its
tokens, what a 1-token decoding step would. In bfloat16 on a CPU the linear layers already do
(each output row is its own dot products, measured bit-identical for 1..8 rows), but attention
does not: a verify query reduces over the whole block's keys (the later ones masked to zero) and
a decoding step over fewer, and a reduction over a different length rounds differently. Near a
tie that flips the argmax (issue 16: 6 of 12 bf16 outputs differed with sdpa, 0 with this).

So, after the prompt, each query row attends to exactly the keys a decoding step at its position
would see, through the same kernel call with the same shapes: one call per row. The prompt's own
forward (no cache yet) is the same in plain and speculative decoding and runs as plain sdpa.
Batch 1 without padding only: the engine passes no attention mask, none is built for this
implementation, and a batch is refused. Not for sliding-window models (implementation_for).
"""

from __future__ import annotations

NAME = "rowwise_sdpa"  # transformers treats any name containing "flash" as flash attention
GQA_NAME = "gqa_sdpa"
MAX_ROWS = 64  # above this a forward is a prompt chunk, not a verify block: one masked call


def rowwise_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      **kwargs):
    """(B, heads, T, D) query against (B, kv_heads, past + T, D) keys -> (B, T, heads, D)."""
    import torch
    import torch.nn.functional as F
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError(f"{NAME} attention serves one unpadded sequence (batch 1, no mask)")
    rows, past = query.shape[2], key.shape[2] - query.shape[2]
    if past == 0:  # the prompt's forward: causal from the first key
        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout,
                                      scaling=scaling, **kwargs)
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    if rows > MAX_ROWS:  # row i sees keys up to past + i
        causal = torch.ones(rows, past + rows, dtype=torch.bool, device=query.device).tril(past)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal, scale=scaling,
                                             enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    out = [F.scaled_dot_product_attention(query[:, :, i:i + 1], key[:, :, :past + i + 1],
                                          value[:, :, :past + i + 1], scale=scaling,
                                          enable_gqa=gqa)
           for i in range(rows)]
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


def gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                  is_causal=None, packed=None, **_kwargs):
    """(B, heads, T, D) query against (B, kv_heads, S, D) keys, mask (B, 1, T, S) or None ->
    (B, T, heads, D); without a mask, causal when T > 1 (the keys are then the query's own).

    With `packed` (a dflash.slots.PackedView), the query is (1, heads, T, D), the tokens of n
    rows side by side, and the keys, values and mask are the padded (n, ...) ones: the rows of a
    few tokens attend padded to the widest of them, as a padded forward's would (padding queries
    see their row's slots and are dropped), each wide row (a prompt chunk) on its own against
    its own slots; the output comes back packed (1, T, heads, D)."""
    import torch
    import torch.nn.functional as F

    if packed is not None:
        q = query[0].transpose(0, 1)  # (T, heads, D)
        out = q.new_empty(q.shape)
        padded = packed.pad(q).transpose(1, 2)  # (n, heads, width, D)
        few, _ = gqa_attention(module, padded, key, value, attention_mask, dropout, scaling,
                               is_causal=False)  # (n, width, heads, D)
        packed.unpad(few, out)
        for i in packed.wide:
            lo, count, start = packed.offsets[i], packed.counts[i], packed.starts[i]
            slots = torch.arange(start + count, device=q.device)  # query t sees <= start + t
            mask = None if start == 0 else \
                (slots[None] <= start + torch.arange(count, device=q.device)[:, None])[None, None]
            own, _ = gqa_attention(module, query[:, :, lo:lo + count],
                                   key[i:i + 1, :, :start + count],
                                   value[i:i + 1, :, :start + count], mask, dropout, scaling,
                                   is_causal=True)  # (1, count, heads, D)
            out[lo:lo + count] = own[0]
        return out[None], None

    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                         dropout_p=dropout, scale=scaling, is_causal=is_causal,
                                         enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register_gqa() -> str:
    """Make GQA_NAME a transformers attention implementation, masks as sdpa's (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_NAME, gqa_attention)
    AttentionMaskInterface.register(GQA_NAME, sdpa_mask)
    return GQA_NAME


def register() -> str:
    """Make NAME a transformers attention implementation (idempotent); returns NAME."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, rowwise_attention)
    return NAME


def implementation_for(dtype, config=None, device: str = "cpu") -> str:
    """The attention the target runs in `dtype`: row-wise in half precision, gqa_sdpa otherwise
    on CPU (measured there), sdpa otherwise on a GPU (where torch's grouped sdpa with a mask
    falls back to its math kernel; not measured here).

    float32 verify forwards differ from decoding steps in the last bits too (the linear layers'
    kernels depend on the row count), which flips a greedy token only at an exact tie: eval and
    verify count any float32 divergence as a mismatch, and none was seen. Models with sliding
    window attention keep sdpa: the row-wise path attends to the whole cache.
    """
    import torch

    if config is not None and sliding_window(config):
        return "sdpa"
    if dtype in (torch.bfloat16, torch.float16):
        return register()
    return register_gqa() if str(device).startswith("cpu") else "sdpa"


def sliding_window(config) -> bool:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if "sliding_attention" in (getattr(text, "layer_types", None) or ()):
        return True
    return bool(getattr(text, "sliding_window", None)) and getattr(text, "use_sliding_window", True)
