"""Making a new DFlash drafter for a target: its config (shape copied from the target), its mask
token (rules in dflash.drafter's docstring) and a fixed-seed random initialisation; and a trained
drafter grown by a layer that starts as the identity (`grow_drafter`)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from dflash_trt.dflash.drafter import ARCHITECTURE, DFlashDraftModel, build_target_layer_ids
from dflash_trt.errors import UsageError


def choose_mask_token_id(tokenizer, embedding_rows: int) -> int:
    """A token id for MASK that exists in the target's embedding (rules in the module docstring)."""
    if len(tokenizer) < embedding_rows:
        return len(tokenizer)
    if tokenizer.mask_token_id is not None and tokenizer.mask_token_id < embedding_rows:
        return tokenizer.mask_token_id
    common = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
              tokenizer.unk_token_id}
    # added_tokens_decoder also lists special tokens that a GGUF tokenizer lost the role of.
    special = [i for i, tok in tokenizer.added_tokens_decoder.items()
               if tok.special and i not in common and i < embedding_rows]
    if special:
        return max(special)
    if tokenizer.pad_token_id is not None and tokenizer.pad_token_id < embedding_rows:
        return tokenizer.pad_token_id
    return embedding_rows - 1


def drafter_config_for_target(target_config, *, num_layers: int, block_size: int,
                              target_layer_ids: list[int] | None, mask_token_id: int):
    """A drafter config that copies hidden size, heads, head_dim, MLP size and RoPE from a target."""
    from transformers import Qwen3Config

    t = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    num_target_layers = t.num_hidden_layers
    ids = list(target_layer_ids) if target_layer_ids else build_target_layer_ids(
        num_target_layers, num_layers)
    bad = [i for i in ids if not 0 <= i < num_target_layers]
    if bad:
        raise UsageError(f"target_layer_ids {bad} out of range: the target has "
                             f"{num_target_layers} layers (valid ids 0..{num_target_layers - 1})")
    if not 0 <= mask_token_id < t.vocab_size:
        raise UsageError(f"mask_token_id {mask_token_id} is not in the target's embedding "
                             f"(vocab_size {t.vocab_size})")
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    return Qwen3Config(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=getattr(t, "num_key_value_heads", None) or t.num_attention_heads,
        head_dim=head_dim, rms_norm_eps=t.rms_norm_eps, hidden_act=t.hidden_act,
        rope_parameters=dict(t.rope_parameters), vocab_size=t.vocab_size,
        max_position_embeddings=t.max_position_embeddings, attention_bias=False,
        num_hidden_layers=num_layers, tie_word_embeddings=False, architectures=[ARCHITECTURE],
        block_size=block_size, num_target_layers=num_target_layers,
        dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": ids})


def init_drafter_for_target(target_dir: Path, *, num_layers: int = 1, block_size: int = 16,
                            target_layer_ids: list[int] | None = None,
                            mask_token_id: int | None = None, seed: int = 0) -> DFlashDraftModel:
    """A randomly initialised (untrained) drafter shaped for the target checkpoint in target_dir."""
    from transformers import AutoConfig, AutoTokenizer

    target_config = AutoConfig.from_pretrained(target_dir)
    if mask_token_id is None:
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        mask_token_id = choose_mask_token_id(tokenizer, target_config.vocab_size)
    config = drafter_config_for_target(target_config, num_layers=num_layers,
                                       block_size=block_size, target_layer_ids=target_layer_ids,
                                       mask_token_id=mask_token_id)
    return init_drafter(config, seed=seed)


def init_drafter(config, *, seed: int = 0) -> DFlashDraftModel:
    """Build a drafter from its config with a fixed-seed initialisation (std = initializer_range)."""
    generator = torch.Generator().manual_seed(seed)
    model = DFlashDraftModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, config.initializer_range, generator=generator)
    return model.eval()


def grow_drafter(drafter: DFlashDraftModel) -> DFlashDraftModel:
    """The drafter with one more layer that drafts exactly as it does, to train further: the new
    last layer copies the last one with its output projections (attention's o_proj, the MLP's
    down_proj; biases too) zeroed, so both of its residual branches add nothing until training
    moves them. The copy has the drafter's dtype, device and draft vocabulary."""
    config = copy.deepcopy(drafter.config)
    config.num_hidden_layers += 1
    config.layer_types = [*config.layer_types, config.layer_types[-1]]
    # Pin the target layers it reads: derived from the layer count, they would change with it.
    config.dflash_config = {**(getattr(config, "dflash_config", None) or {}),
                            "target_layer_ids": list(drafter.target_layer_ids)}
    last = len(drafter.layers) - 1
    state = drafter.state_dict()
    for key, value in list(state.items()):
        if key.startswith(f"layers.{last}."):
            grown = value.clone()
            if key.endswith(("o_proj.weight", "o_proj.bias", "down_proj.weight", "down_proj.bias")):
                grown.zero_()
            state[key.replace(f"layers.{last}.", f"layers.{last + 1}.", 1)] = grown
    weight = drafter.fc.weight
    grown = DFlashDraftModel(config).to(device=weight.device, dtype=weight.dtype)
    grown.load_state_dict(state, strict=True)
    grown.set_draft_vocab(drafter.draft_vocab)
    return grown.eval()
