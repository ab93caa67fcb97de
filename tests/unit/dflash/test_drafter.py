"""dflash.drafter: the reference checkpoint format, save/load, initialisation from a target."""

from __future__ import annotations

import json

import pytest
import torch
from dflash_fixtures import tiny_drafter, tiny_target

from dflash_trt.dflash.drafter import (
    DFlashDraftModel,
    build_target_layer_ids,
)
from dflash_trt.dflash.drafter_init import (
    choose_mask_token_id,
    drafter_config_for_target,
    grow_drafter,
)
from dflash_trt.errors import DflashTrtError

REFERENCE_LAYER_KEYS = [
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "input_layernorm.weight", "post_attention_layernorm.weight"]


def reference_keys(num_layers: int) -> set[str]:
    keys = {f"layers.{i}.{k}" for i in range(num_layers) for k in REFERENCE_LAYER_KEYS}
    return keys | {"norm.weight", "fc.weight", "hidden_norm.weight"}


def test_reference_target_layer_rule():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(30, 1) == [15]
    assert build_target_layer_ids(30, 2) == [1, 27]


def test_state_dict_has_exactly_the_reference_keys():
    drafter = tiny_drafter(tiny_target(), num_layers=2)
    assert set(drafter.state_dict()) == reference_keys(2)


def _draft(drafter, seed=0):
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(1, drafter.block_size, 64, generator=g)
    context = torch.randn(1, 7, 64 * len(drafter.target_layer_ids), generator=g)
    with torch.inference_mode():
        return drafter(noise, context, drafter.new_cache())


def test_save_and_reload_gives_identical_drafts(tmp_path):
    drafter = tiny_drafter(tiny_target("qwen3"), num_layers=2, block_size=8, seed=4)
    drafter.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 8 and config["num_target_layers"] == 4
    assert config["dflash_config"] == {"mask_token_id": 127, "target_layer_ids": [1, 1]}
    reloaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert torch.equal(_draft(drafter), _draft(reloaded))


def test_a_grown_drafter_drafts_as_before_until_its_new_layer_trains(tmp_path):
    drafter = tiny_drafter(tiny_target("qwen3"), num_layers=2, block_size=8, seed=4)
    drafter.set_draft_vocab([3, 5, 9])
    grown = grow_drafter(drafter)
    assert len(grown.layers) == 3 and grown.config.num_hidden_layers == 3
    assert grown.target_layer_ids == drafter.target_layer_ids  # not re-derived for 3 layers
    assert grown.draft_vocab.tolist() == [3, 5, 9] and grown.fc.weight.dtype == torch.float32
    assert torch.equal(_draft(drafter), _draft(grown))  # exact: the new layer adds zeros
    grown.save_pretrained(tmp_path)
    reloaded = DFlashDraftModel.from_pretrained(tmp_path)
    assert torch.equal(_draft(grown), _draft(reloaded))
    with torch.no_grad():  # the new layer is wired in: once its output moves, the drafts do
        grown.layers[2].self_attn.o_proj.weight.normal_(0, 0.1)
    assert not torch.allclose(_draft(drafter), _draft(grown))


def test_draft_vocabulary_is_saved_beside_the_reference_weights(tmp_path):
    drafter = tiny_drafter(tiny_target("qwen3"), block_size=4)
    keys = set(drafter.state_dict())
    drafter.set_draft_vocab([1, 5, 9])
    assert set(drafter.state_dict()) == keys  # model.safetensors keeps the reference keys
    drafter.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "draft_vocab.json").read_text()) == {"token_ids": [1, 5, 9]}
    assert DFlashDraftModel.from_pretrained(tmp_path).draft_vocab.tolist() == [1, 5, 9]
    (tmp_path / "draft_vocab.json").write_text('{"token_ids": [5, 1]}')
    with pytest.raises(DflashTrtError, match="strictly increasing"):
        DFlashDraftModel.from_pretrained(tmp_path)
    (tmp_path / "draft_vocab.json").write_text('[1, 2]')
    with pytest.raises(DflashTrtError, match="expected"):
        DFlashDraftModel.from_pretrained(tmp_path)
    (tmp_path / "draft_vocab.json").write_text('{"token_ids": [1, 128]}')  # vocab_size 128
    with pytest.raises(DflashTrtError, match="outside the vocabulary"):
        DFlashDraftModel.from_pretrained(tmp_path)
    drafter.set_draft_vocab(None)
    drafter.save_pretrained(tmp_path)  # no vocabulary now: no stale file either
    assert not (tmp_path / "draft_vocab.json").exists()
    assert DFlashDraftModel.from_pretrained(tmp_path).draft_vocab is None


def test_an_interrupted_save_leaves_the_previous_drafter_whole(tmp_path, monkeypatch):
    import safetensors.torch

    drafter = tiny_drafter(tiny_target(), block_size=4, target_layer_ids=[0, 3])
    drafter.set_draft_vocab(torch.tensor([1, 2, 5]))
    out = tmp_path / "drafter"
    drafter.save_pretrained(out)
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    assert set(before) == {"config.json", "model.safetensors", "draft_vocab.json"}

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # config.json written, the weights not yet

    monkeypatch.setattr(safetensors.torch, "save_file", killed)
    drafter.to(torch.bfloat16)  # a config.json of its own
    with pytest.raises(KeyboardInterrupt):
        drafter.save_pretrained(out)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # nothing left beside it


def test_injected_context_in_pieces_equals_all_at_once():
    """KV injection through the cache: context fed in two steps drafts the same block."""
    drafter = tiny_drafter(tiny_target(), block_size=4, target_layer_ids=[0, 3])
    g = torch.Generator().manual_seed(1)
    noise = torch.randn(1, 4, 64, generator=g)
    context = torch.randn(1, 9, 128, generator=g)
    with torch.inference_mode():
        whole = drafter(noise, context, drafter.new_cache())
        cache = drafter.new_cache()
        drafter(torch.randn(1, 4, 64, generator=g), context[:, :5], cache)
        cache.crop(5)
        pieces = drafter(noise, context[:, 5:], cache)
    assert torch.allclose(whole, pieces, atol=1e-5)
    assert cache.get_seq_length() == 9 + 4


def test_hand_written_reference_checkpoint_loads(tmp_path):
    """A config and tensors written the way published z-lab drafters are (bf16, auto_map, rope_theta)."""
    from safetensors.torch import save_file

    config = {"architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
              "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
              "vocab_size": 128, "max_position_embeddings": 4096, "hidden_act": "silu",
              "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
              "block_size": 16, "num_target_layers": 8, "use_sliding_window": False,
              "dflash_config": {"mask_token_id": 120, "target_layer_ids": [1, 5]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shapes = {"self_attn.q_proj.weight": (64, 64), "self_attn.k_proj.weight": (32, 64),
              "self_attn.v_proj.weight": (32, 64), "self_attn.o_proj.weight": (64, 64),
              "self_attn.q_norm.weight": (16,), "self_attn.k_norm.weight": (16,),
              "mlp.gate_proj.weight": (96, 64), "mlp.up_proj.weight": (96, 64),
              "mlp.down_proj.weight": (64, 96), "input_layernorm.weight": (64,),
              "post_attention_layernorm.weight": (64,)}
    tensors = {f"layers.0.{k}": torch.randn(s, dtype=torch.bfloat16) for k, s in shapes.items()}
    tensors |= {"norm.weight": torch.ones(64, dtype=torch.bfloat16),
                "fc.weight": torch.randn(64, 128, dtype=torch.bfloat16),
                "hidden_norm.weight": torch.ones(64, dtype=torch.bfloat16)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    drafter = DFlashDraftModel.from_pretrained(tmp_path)
    assert (drafter.block_size, drafter.mask_token_id, drafter.target_layer_ids) == (16, 120, [1, 5])
    assert torch.equal(drafter.fc.weight, tensors["fc.weight"].float())
    assert drafter.rotary_emb.inv_freq[1].item() == pytest.approx(1e6 ** (-2 / 16))
    assert _draft(drafter).shape == (1, 16, 64)

    del tensors["hidden_norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(DflashTrtError, match="hidden_norm.weight"):
        DFlashDraftModel.from_pretrained(tmp_path)
    config["architectures"] = ["Qwen3ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DflashTrtError, match="DFlashDraftModel"):
        DFlashDraftModel.from_pretrained(tmp_path)


def test_init_copies_target_geometry_and_rope():
    from transformers import LlamaConfig

    target = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=12,
                         num_attention_heads=8, num_key_value_heads=2, vocab_size=1000,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                          "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})
    config = drafter_config_for_target(target, num_layers=3, block_size=8, target_layer_ids=None,
                                       mask_token_id=5)
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim) == (256, 8, 2, 32)
    assert config.rope_parameters == target.rope_parameters
    assert config.dflash_config == {"mask_token_id": 5, "target_layer_ids": [1, 5, 9]}
    with pytest.raises(DflashTrtError, match="out of range"):
        drafter_config_for_target(target, num_layers=1, block_size=8, target_layer_ids=[12],
                                  mask_token_id=5)
    with pytest.raises(DflashTrtError, match="mask_token_id"):
        drafter_config_for_target(target, num_layers=1, block_size=8, target_layer_ids=None,
                                  mask_token_id=1000)


class _Tok:
    """Just the tokenizer surface that choose_mask_token_id reads."""

    def __init__(self, size, special=(), mask=None, bos=None, eos=None, pad=None, unk=None):
        from tokenizers import AddedToken

        self.size = size
        self.mask_token_id, self.bos_token_id, self.eos_token_id = mask, bos, eos
        self.pad_token_id, self.unk_token_id = pad, unk
        self.added_tokens_decoder = {i: AddedToken(f"<{i}>", special=True) for i in special}

    def __len__(self):
        return self.size


def test_mask_token_choice_per_tokenizer():
    # Qwen3: embedding rows past the tokenizer -> the first unused row (the reference's 151669).
    assert choose_mask_token_id(_Tok(151669, special=[151643, 151645]), 151936) == 151669
    # SmolLM2: embedding == tokenizer -> highest special that is not bos/eos/pad/unk.
    smol = _Tok(49152, special=range(17), bos=1, eos=2, pad=2, unk=0)
    assert choose_mask_token_id(smol, 49152) == 16
    assert choose_mask_token_id(_Tok(100, mask=7), 100) == 7
    assert choose_mask_token_id(_Tok(100, pad=3, eos=4), 100) == 3
    assert choose_mask_token_id(_Tok(100), 100) == 99
