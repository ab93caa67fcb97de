"""The DFlash drafter: a few Qwen3-style layers that draft a whole block from target features.

Checkpoint format (the reference z-lab/dflash format, so published drafters load unchanged):
`config.json` is a Qwen3 config with `architectures: ["DFlashDraftModel"]`, `block_size`,
`num_target_layers` and `dflash_config: {mask_token_id, target_layer_ids}`; `model.safetensors`
holds `layers.N.self_attn.{q,k,v,o}_proj.weight`, `layers.N.self_attn.{q,k}_norm.weight`,
`layers.N.mlp.{gate,up,down}_proj.weight`, `layers.N.{input,post_attention}_layernorm.weight`,
`norm.weight`, `fc.weight`, `hidden_norm.weight`. The drafter has no embedding or LM head: it
borrows the target's.

Optional `draft_vocab.json` (`{"token_ids": [...]}`, sorted): the drafter drafts only these tokens,
through those rows of the target's LM head (a drafter trained with `--vocab-limit` never learned
the others). Drafting costs a sixth of the head on SmolLM2 (8,192 of 49,152 rows); verification
always uses the whole vocabulary, so output is unchanged. Readers that do not know the file draft
over the whole vocabulary.

Mask token id, when not given (`dflash.drafter_init.choose_mask_token_id`):
- Qwen3 family (embedding 151936 rows, tokenizer 151669 tokens): 151669, the first embedding row
  past the tokenizer, exactly what the reference drafters use.
- Any target whose embedding has rows past the tokenizer: the first such row (never produced).
- SmolLM2 (embedding == tokenizer == 49152): the tokenizer's mask token if it has one, else its
  highest-id special token that is not bos/eos/pad/unk (`<empty_output>`, id 16).
- Otherwise the pad token, else the last vocabulary row.
"""

from __future__ import annotations

import functools
import json
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.atomic import replacing_dir
from dflash_trt.errors import DflashTrtError

ARCHITECTURE = "DFlashDraftModel"
DRAFT_VOCAB_FILE = "draft_vocab.json"
# Generic PretrainedConfig fields that mean nothing for a drafter; left out of config.json.
_CONFIG_NOISE = {"_name_or_path", "id2label", "label2id", "chunk_size_feed_forward",
                 "problem_type", "is_encoder_decoder", "return_dict", "output_attentions",
                 "output_hidden_states"}


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference rule: evenly spaced from 1 to L-3; a single drafter layer uses [L // 2]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


class DraftCache:
    """Per-layer keys and values of the injected context (the drafter's KV cache).

    Each layer's K/V live in a buffer that grows by doubling, so appending C positions copies C
    positions (not the whole cache) and `crop` only moves the length.
    """

    def __init__(self, num_layers: int):
        self._keys: list[torch.Tensor | None] = [None] * num_layers  # (B, nkv, capacity, hd)
        self._values: list[torch.Tensor | None] = [None] * num_layers
        self._lengths = [0] * num_layers

    def get_seq_length(self) -> int:
        return self._lengths[0]

    def get(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Views of layer's filled keys and values (B, nkv, S, hd); None before the first update."""
        k, v, n = self._keys[layer], self._values[layer], self._lengths[layer]
        return (None, None) if k is None else (k[..., :n, :], v[..., :n, :])

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Append k, v (B, nkv, C, hd) after the layer's cached positions; return all of them."""
        start = self._lengths[layer]
        end = start + k.shape[-2]
        old_k, old_v = self._keys[layer], self._values[layer]
        if old_k is None or end > old_k.shape[-2]:
            capacity = max(end, 64 if old_k is None else 2 * old_k.shape[-2])
            shape = (*k.shape[:-2], capacity, k.shape[-1])
            self._keys[layer], self._values[layer] = k.new_empty(shape), v.new_empty(shape)
            if start:
                self._keys[layer][..., :start, :] = old_k[..., :start, :]
                self._values[layer][..., :start, :] = old_v[..., :start, :]
        self._keys[layer][..., start:end, :] = k
        self._values[layer][..., start:end, :] = v
        self._lengths[layer] = end
        return self.get(layer)  # (B, nkv, S+C, hd) each

    def crop(self, length: int) -> None:
        """Drop everything past `length` positions (the block's own keys after drafting)."""
        self._lengths = [min(n, length) for n in self._lengths]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin  # cos, sin: (B, 1, T, hd) broadcast over heads


class DFlashAttention(nn.Module):
    """Attention whose keys/values come from the injected context and the block; queries from the block."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        bias, hidden = config.attention_bias, config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x, context, cos, sin, cache: DraftCache | None):
        b, t, _ = x.shape  # x: (B, T, H) block; context: (B, C, H) new target features
        q = self.q_norm(self.q_proj(x).view(b, t, -1, self.head_dim)).transpose(1, 2)  # (B, nh, T, hd)
        kv_in = torch.cat([context, x], dim=1)  # (B, C+T, H)
        k = self.k_norm(self.k_proj(kv_in).view(b, kv_in.shape[1], -1, self.head_dim))
        k = k.transpose(1, 2)  # (B, nkv, C+T, hd)
        v = self.v_proj(kv_in).view(b, kv_in.shape[1], -1, self.head_dim).transpose(1, 2)
        q = _rope(q, cos[:, :, -t:], sin[:, :, -t:])  # block positions are the last T
        k = _rope(k, cos, sin)  # context and block at their absolute positions
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, nkv, S+C+T, hd)
        # Non-causal: every block position sees all context and the whole block.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=False,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))  # (B, T, H)

    def forward_rows(self, x, context, ctx_rope, block_rope, view, ctx_mask):
        """forward for rows with their own cached lengths (dflash.slots): the context's K/V are
        written into each row's slots, the block's are not cached.

        x: (n, T, H) block or None (inject the context only); context: (n, C, H) right-padded;
        ctx_rope, block_rope: (cos, sin) at each row's positions; ctx_mask: (n, 1, 1, top) the
        cached slots each row may see (its old context plus its real new context).
        """
        n, c, _ = context.shape
        k = self.k_norm(self.k_proj(context).view(n, c, self.num_kv_heads, self.head_dim))
        v = self.v_proj(context).view(n, c, self.num_kv_heads, self.head_dim)
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (n, nkv, C, hd)
        keys, values = view.write(self.layer_idx, _rope(k, *ctx_rope), v)  # (n, nkv, top, hd)
        if x is None:
            return None
        t = x.shape[1]
        q = self.q_norm(self.q_proj(x).view(n, t, self.num_heads, self.head_dim)).transpose(1, 2)
        kb = self.k_norm(self.k_proj(x).view(n, t, self.num_kv_heads, self.head_dim))
        vb = self.v_proj(x).view(n, t, self.num_kv_heads, self.head_dim)
        kb, vb = kb.transpose(1, 2), vb.transpose(1, 2)  # (n, nkv, T, hd)
        keys = torch.cat([keys, _rope(kb, *block_rope)], dim=2)
        values = torch.cat([values, vb], dim=2)
        mask = torch.cat([ctx_mask, ctx_mask.new_ones(n, 1, 1, t)], dim=-1)  # (n, 1, 1, top+T)
        out = F.scaled_dot_product_attention(_rope(q, *block_rope), keys, values, attn_mask=mask,
                                             enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(n, t, -1))  # (n, T, H)

    def forward_ops(self, x, cos, sin, cache: DraftCache, ops):
        """The block's attention through `block_draft_attention`, batch 1, context already cached.

        x: (1, T, H) block; cos, sin: (T, hd) at the block's positions. Only the block is
        projected (the context's K/V came from kv_inject). The block's K/V are appended after the
        attention, so the cache ends up as the torch path leaves it.
        """
        t = x.shape[1]
        h = x[0]  # (T, H)
        q = self.q_norm(self.q_proj(h).view(t, -1, self.head_dim)).transpose(0, 1)  # (nh, T, hd)
        k = self.k_norm(self.k_proj(h).view(t, -1, self.head_dim)).transpose(0, 1)  # (nkv, T, hd)
        v = self.v_proj(h).view(t, -1, self.head_dim).transpose(0, 1)  # (nkv, T, hd)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k_ctx, v_ctx = cache.get(self.layer_idx)  # (1, nkv, S+C, hd) views, or None
        if k_ctx is None:
            k_ctx = v_ctx = k.new_empty(k.shape[0], 0, self.head_dim)[None]  # no context yet
        out = ops.block_draft_attention(q, k_ctx[0], v_ctx[0], k, v, 0)  # (nh, T, hd)
        cache.update(self.layer_idx, k[None], v[None])
        return self.o_proj(out.transpose(0, 1).reshape(1, t, -1))  # (1, T, H)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, context, cos, sin, cache):
        # The context is not normed per layer: it was normed once by hidden_norm (as the reference).
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_rows(self, x, context, ctx_rope, block_rope, view, ctx_mask):
        out = self.self_attn.forward_rows(None if x is None else self.input_layernorm(x), context,
                                          ctx_rope, block_rope, view, ctx_mask)
        if x is None:
            return None
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_ops(self, x, cos, sin, cache, ops):
        """forward for one block (batch 1) whose context K/V are already in the cache."""
        x = x + self.self_attn.forward_ops(self.input_layernorm(x), cos, sin, cache, ops)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    """Drafter layers plus `fc`/`hidden_norm` that fuse the target's chosen layer outputs."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

        self.config = config
        dflash = getattr(config, "dflash_config", None) or {}
        self.block_size: int = config.block_size
        self.target_layer_ids: list[int] = list(dflash.get("target_layer_ids") or build_target_layer_ids(
            config.num_target_layers, config.num_hidden_layers))
        self.mask_token_id: int | None = dflash.get("mask_token_id")
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size,
                            bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)  # inv_freq is a non-persistent buffer
        # Inference through the DFlash plugin ops; False keeps the plain torch path (same tokens).
        self.use_ops = True
        # (K,) token ids this drafter drafts, or None for the whole vocabulary. A buffer so that it
        # follows .to(device), but not persistent: model.safetensors keeps the reference keys.
        self.register_buffer("draft_vocab", None, persistent=False)

    def set_draft_vocab(self, token_ids) -> None:
        """Draft only these token ids (None: the whole vocabulary)."""
        if token_ids is None:
            self.draft_vocab = None
            return
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().clone()
        vocab = getattr(self.config, "vocab_size", None)
        if ids.numel() == 0 or int(ids.min()) < 0 or not bool((ids[1:] > ids[:-1]).all()):
            raise DflashTrtError(f"{DRAFT_VOCAB_FILE}: token_ids must be non-empty, "
                                 "non-negative and strictly increasing")
        if vocab is not None and int(ids.max()) >= vocab:
            raise DflashTrtError(f"{DRAFT_VOCAB_FILE}: token id {int(ids.max())} is outside the "
                                 f"vocabulary ({vocab}); it belongs to another target")
        self.draft_vocab = ids.to(self.fc.weight.device)

    def new_cache(self) -> DraftCache:
        return DraftCache(len(self.layers))

    def forward(self, noise_embedding, target_hidden, cache: DraftCache | None = None):
        """Hidden states for a block, given the target features not yet in the cache.

        noise_embedding: (B, T, H) embeddings of [last token, MASK...];
        target_hidden: (B, C, k*H) concatenated target layer outputs of the C newest context
        positions. Positions continue from the cache: context at S..S+C-1, block after it.
        Afterwards the cache holds context and block; crop(S+C) drops the block.
        Inference (batch 1 with a cache) runs the DFlash plugin ops when `use_ops` and they load;
        everything else (training, batches, attention bias) runs plain torch.
        """
        ops = self._ops() if cache is not None and noise_embedding.shape[0] == 1 else None
        if ops is not None:
            return self._forward_ops(noise_embedding, target_hidden, cache, ops)
        past = 0 if cache is None else cache.get_seq_length()
        total = target_hidden.shape[1] + noise_embedding.shape[1]
        position_ids = torch.arange(past, past + total, device=noise_embedding.device)[None]  # (1, C+T)
        context = self.hidden_norm(self.fc(target_hidden))  # (B, C, H)
        cos, sin = self.rotary_emb(noise_embedding, position_ids)  # (1, C+T, hd) each
        cos, sin = cos[:, None], sin[:, None]  # (1, 1, C+T, hd)
        x = noise_embedding
        for layer in self.layers:
            x = layer(x, context, cos, sin, cache)
        return self.norm(x)  # (B, T, H)

    def new_slot_cache(self, rows: int, capacity: int):
        """A context cache for `rows` sequences of their own lengths (dflash.slots)."""
        from dflash_trt.dflash.slots import SlotCache

        return SlotCache(len(self.layers), rows, capacity)

    def forward_rows(self, noise_embedding, target_hidden, context_lengths, view):
        """forward for a batch of rows, each with its own cached context length.

        target_hidden: (n, C, k*H) each row's new context features, right-padded to C, of which
        `context_lengths[r]` are real; view: the drafter's SlotCache viewed for C new positions.
        The real context is cached (the caller adds context_lengths to the cache's lengths); the
        block is not. noise_embedding: (n, T, H) or None to inject the context only.
        Returns (n, T, H) or None.
        """
        device = target_hidden.device
        starts = torch.tensor(view.starts, device=device)[:, None]  # (n, 1)
        real = torch.tensor(list(context_lengths), device=device)[:, None]  # (n, 1)
        ctx_pos = view.positions(device)  # (n, C)
        ctx_mask = (torch.arange(view.top, device=device)[None] < starts + real)[:, None, None]
        like = target_hidden if noise_embedding is None else noise_embedding
        ctx_rope = [r[:, None] for r in self.rotary_emb(like, ctx_pos)]  # (n, 1, C, hd) each
        block_rope = None
        if noise_embedding is not None:
            width = noise_embedding.shape[1]
            block_pos = starts + real + torch.arange(width, device=device)[None]  # (n, T)
            block_rope = [r[:, None] for r in self.rotary_emb(like, block_pos)]
        context = self.hidden_norm(self.fc(target_hidden))  # (n, C, H)
        x = noise_embedding
        for layer in self.layers:
            x = layer.forward_rows(x, context, ctx_rope, block_rope, view, ctx_mask)
        return None if x is None else self.norm(x)

    def _ops(self):
        """The plugin ops module, or None when this drafter should (or must) run plain torch."""
        if not self.use_ops or self.config.attention_bias:  # the ops have no bias terms
            return None
        return _load_ops()

    def _forward_ops(self, noise_embedding, target_hidden, cache: DraftCache, ops):
        """forward through kv_inject and block_draft_attention (batch 1, one path for CPU and GPU)."""
        past, num_ctx = cache.get_seq_length(), target_hidden.shape[1]
        total = num_ctx + noise_embedding.shape[1]
        position_ids = torch.arange(past, past + total, device=noise_embedding.device)[None]  # (1, C+T)
        cos, sin = self.rotary_emb(noise_embedding, position_ids)  # (1, C+T, hd) each
        cos, sin = cos[0], sin[0]  # (C+T, hd)
        if num_ctx:
            # 1. KV injection: the new context's K/V for every layer in one op, then cached.
            attn = [layer.self_attn for layer in self.layers]
            kv = ops.kv_inject(target_hidden[0], self.fc.weight, self.hidden_norm.weight,
                               [a.k_proj.weight for a in attn], [a.v_proj.weight for a in attn],
                               [a.k_norm.weight for a in attn], cos[:num_ctx], sin[:num_ctx],
                               self.config.rms_norm_eps)  # (L, 2, nkv, C, hd)
            for i, layer_kv in enumerate(kv):
                cache.update(i, layer_kv[0][None], layer_kv[1][None])  # (1, nkv, S+C, hd)
        # 2. The block: each layer projects only the block and attends over cache + block.
        x = noise_embedding  # (1, T, H)
        for layer in self.layers:
            x = layer.forward_ops(x, cos[num_ctx:], sin[num_ctx:], cache, ops)
        return self.norm(x)  # (1, T, H)

    def save_pretrained(self, path: Path | str) -> None:
        """Write config.json, model.safetensors and draft_vocab.json (if it drafts over part of
        the vocabulary) in the reference format. The directory is replaced whole (filled beside
        it, then renamed): an interrupted save leaves the previous drafter or none, never a mix."""
        from safetensors.torch import save_file

        config = {k: v for k, v in self.config.to_dict().items() if k not in _CONFIG_NOISE}
        config["architectures"] = [ARCHITECTURE]
        config["rope_theta"] = config.get("rope_parameters", {}).get("rope_theta")  # older readers
        config["dtype"] = str(next(self.parameters()).dtype).removeprefix("torch.")
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing_dir(path) as out:
            (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
            save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
            if self.draft_vocab is not None:
                write_draft_vocab(out, self.draft_vocab.tolist())

    @classmethod
    def from_pretrained(cls, path: Path | str, *, state_dict: dict | None = None,
                        dtype: torch.dtype = torch.float32, device: str = "cpu") -> DFlashDraftModel:
        """Load a drafter in the reference format (strict: every key, no extras)."""
        path = Path(path)
        model = cls(load_drafter_config(path))
        if state_dict is None:
            state_dict = _read_safetensors(path)
        missing, unexpected = model.load_state_dict(state_dict, strict=False)
        if missing or unexpected:
            raise DflashTrtError(f"{path}: not a DFlash drafter checkpoint (missing keys "
                                 f"{sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]})")
        model.set_draft_vocab(read_draft_vocab(path))
        return model.to(device=device, dtype=dtype).eval()


def write_draft_vocab(out: Path, token_ids: list[int]) -> None:
    (Path(out) / DRAFT_VOCAB_FILE).write_text(json.dumps({"token_ids": list(token_ids)}) + "\n")


def read_draft_vocab(path: Path) -> list[int] | None:
    """The token ids of `path/draft_vocab.json`, or None when the drafter has no such file."""
    file = Path(path) / DRAFT_VOCAB_FILE
    if not file.is_file():
        return None
    try:
        ids = json.loads(file.read_text())["token_ids"]
    except (ValueError, KeyError, TypeError):
        raise DflashTrtError(f"{file}: expected {{\"token_ids\": [sorted token ids]}}") from None
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise DflashTrtError(f"{file}: token_ids must be a list of integers")
    return ids


@functools.cache
def _load_ops():
    """The DFlash plugin ops, imported on first use; None (with one warning) if they cannot load."""
    from dflash_trt.plugins import load_dflash_ops

    try:
        return load_dflash_ops()
    except (ImportError, DflashTrtError) as exc:
        warnings.warn(f"DFlash plugin ops unavailable ({exc}); the drafter runs plain torch",
                      stacklevel=3)
        return None


def load_drafter_config(path: Path):
    """Read and check a drafter's config.json (a Qwen3 config plus the DFlash fields)."""
    from transformers import Qwen3Config

    file = path / "config.json"
    if not file.is_file():
        raise DflashTrtError(f"{path}: no config.json; expected a DFlash drafter directory")
    raw = json.loads(file.read_text())
    if ARCHITECTURE not in (raw.get("architectures") or []):
        raise DflashTrtError(f"{file}: architectures must contain {ARCHITECTURE!r} "
                             f"(found {raw.get('architectures')})")
    for key in ("block_size", "num_target_layers", "hidden_size", "num_hidden_layers"):
        if key not in raw:
            raise DflashTrtError(f"{file}: missing {key!r}; not a DFlash drafter config")
    if raw.get("use_sliding_window"):
        raise DflashTrtError(f"{file}: sliding-window drafters are not supported")
    raw.pop("auto_map", None)  # never run checkpoint code; this module is the implementation
    raw.pop("quantization_config", None)  # handled by dflash_trt.formats.load before we get here
    for drop in ("model_type", "transformers_version"):
        raw.pop(drop, None)
    raw.setdefault("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
    return Qwen3Config(**raw)


def _read_safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise DflashTrtError(f"{path}: no .safetensors weights in the drafter directory")
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    return state
