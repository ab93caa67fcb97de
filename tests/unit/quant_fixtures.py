"""Tiny resolved build dirs for the quantize/verify tests: a real HF target with a char tokenizer
and a DFlash drafter, written to disk as the `resolve` stage would, plus a stand-in StageContext."""

from __future__ import annotations

import string
from pathlib import Path

from dflash_fixtures import VOCAB, tiny_drafter, tiny_target


def char_tokenizer():
    """A character-level fast tokenizer (102 ids < VOCAB) built in-process: no files, no network."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    assert len(vocab) < VOCAB - 1  # the last id is the drafter's mask token
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")


def write_resolved(resolved: Path, *, target=None, drafter=None, seed: int = 0):
    """Write resolved/target (+ tokenizer) and resolved/drafter; return (target, drafter)."""
    target = target if target is not None else tiny_target("llama", seed=seed, layers=4)
    target.config.architectures = [type(target).__name__]
    target.save_pretrained(resolved / "target")
    char_tokenizer().save_pretrained(resolved / "target")
    drafter = drafter if drafter is not None else tiny_drafter(
        target, block_size=4, num_layers=1, target_layer_ids=[1, 2])
    drafter.save_pretrained(resolved / "drafter")
    return target, drafter


def make_recipe(root: Path, *, target_format="nvfp4", drafter_format="nvfp4", kv_cache="none",
                verify=None, block_size=4):
    from dflash_trt.recipe import Recipe

    return Recipe.model_validate({
        "name": "tiny", "output_dir": str(root),
        "target": {"source": str(root / "tiny" / "resolved" / "target"), "dtype": "float32",
                   "chat_template": False},
        "drafter": {"source": str(root / "tiny" / "resolved" / "drafter"), "block_size": block_size},
        "quantize": {"target": {"format": target_format, "kv_cache": kv_cache},
                     "drafter": {"format": drafter_format},
                     "calibration": {"data": ["builtin:python-stdlib", "builtin:chat"],
                                     "calib_size": 4, "seq_len": 32, "batch_size": 2}},
        "verify": verify or {"prompts": "builtin:chat", "num_prompts": 2, "max_new_tokens": 8},
        "engine": {"device": "cpu", "max_seq_len": 256},
    })


def stage_context(recipe, stage_out: str):
    """A StageContext for one stage with its output dir created empty."""
    from dflash_trt.stages.pipeline import StageContext

    build_dir = Path(recipe.output_dir) / recipe.name
    out = build_dir / f".tmp-{stage_out}"
    out.mkdir(parents=True)
    return StageContext(recipe=recipe, build_dir=build_dir, out=out)
