"""The target model as generation sees it: forward with a KV cache, chosen layer features, logits.

Wraps a Hugging Face causal LM (Llama/Qwen family: `model.model.layers`, `embed_tokens`, `lm_head`).
Only the layers the drafter reads are captured (forward hooks), and the LM head runs outside the
forward, so the caller computes logits only for the positions it needs.
"""

from __future__ import annotations

import torch
from torch import nn

from dflash_trt.dflash.attention import GQA_NAME
from dflash_trt.dflash.slots import PackedView, SlotCache, SlotView


class HFTarget:
    """A Hugging Face causal LM, with the outputs of `layer_ids` captured on request."""

    def __init__(self, model: nn.Module, layer_ids: list[int] | None = None):
        self.model = model
        self.base = model.get_decoder() if hasattr(model, "get_decoder") else model.model
        self.lm_head = model.get_output_embeddings()
        self.embed_tokens = model.get_input_embeddings()
        self.layer_ids = list(layer_ids or [])
        self._captured: dict[int, torch.Tensor] | None = None
        self._rows: tuple | None = None  # (key, head rows of the ids, the ids)
        layers = self.base.layers
        for layer_id in self.layer_ids:
            layers[layer_id].register_forward_hook(self._hook(layer_id))

    def _hook(self, layer_id: int):
        def keep_output(_module, _args, output):
            if self._captured is not None:
                self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
        return keep_output

    @property
    def packs(self) -> bool:
        """Whether `forward` takes a PackedView: its attention (dflash.attention's gqa_sdpa, the
        CPU float path) unpacks the queries; other implementations would ignore the layout."""
        return getattr(self.model.config, "_attn_implementation", None) == GQA_NAME

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def new_slot_cache(self, rows: int, capacity: int) -> SlotCache:
        """A cache for `rows` sequences of their own lengths (dflash.slots; pass views of it)."""
        return SlotCache(len(self.base.layers), rows, capacity)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids)  # (B, T) -> (B, T, H)

    def forward(self, ids: torch.Tensor, cache, capture: bool):
        """Run ids (B, T) after the cache; return final hidden (B, T, H) and features or None.

        Features are the chosen layers' outputs (hidden_states[id + 1]) concatenated: (B, T, k*H).
        Positions continue from the cache length, which the caller keeps cropped; with a SlotView
        each row continues from its own length (positions per row, and a mask per row unless all
        rows start at the same slot). With a PackedView (when `packs`), ids (1, T) are the rows'
        tokens side by side and the outputs come back packed the same way: (1, T, ...).
        """
        rows = {}
        if isinstance(cache, SlotView):
            rows = {"attention_mask": cache.causal_mask(ids.device),
                    "position_ids": cache.positions(ids.device)}
        if isinstance(cache, PackedView):
            if not self.packs:
                raise ValueError("a packed forward needs the gqa_sdpa attention (HFTarget.packs)")
            rows["packed"] = cache
        self._captured = {} if capture and self.layer_ids else None
        try:
            out = self.base(input_ids=ids, past_key_values=cache, use_cache=True, **rows)
        finally:
            captured, self._captured = self._captured, None
        features = None
        if captured is not None:
            features = torch.cat([captured[i] for i in self.layer_ids], dim=-1)  # (B, T, k*H)
        return out.last_hidden_state, features

    @property
    def vocab_size(self) -> int:
        return int(self.lm_head.weight.shape[0])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # (..., H) -> (..., V)

    def logits_rows(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Logits of the token ids `ids` (K,) only: (..., H) -> (..., K), through a copy of those
        LM-head rows made on first use (a plain, bias-free head; any other head is sliced),
        packed for oneDNN where the head is (dflash.cpu_linear)."""
        from dflash_trt.dflash import cpu_linear

        head = self.lm_head
        if not cpu_linear.is_plain(head):
            return self.logits(hidden)[..., ids]
        weight = head.weight
        key = (id(ids), weight.data_ptr(), weight.dtype, weight.device)
        if self._rows is None or self._rows[0] != key:  # new ids, or the head moved / was cast
            rows = weight.detach()[ids].contiguous()  # (K, H)
            packed = cpu_linear.pack(rows) if isinstance(head, cpu_linear.PackedLinear) else None
            self._rows = (key, rows, packed, ids)  # keeps ids alive
        if self._rows[2] is not None:
            return cpu_linear.packed_linear(hidden, self._rows[2], None).float()
        return (hidden @ self._rows[1].T).float()
