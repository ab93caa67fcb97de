"""A tiny target with a learnable pattern, and greedy data from it, for the training tests.

The target is a real tiny Llama whose attention and MLP outputs are zeroed, so its next token is a
fixed function of the current token (a bigram chain). Its greedy continuations are what a drafter
can learn in a few dozen steps on CPU.
"""

from __future__ import annotations

import torch
from dflash_fixtures import VOCAB, tiny_drafter, tiny_target

from dflash_trt.dflash.target import HFTarget
from dflash_trt.training.corpus import TokenSequence


def bigram_target():
    model = tiny_target("llama", seed=1, layers=3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


def greedy_sequences(model, count: int, *, seed: int = 0, prompt_len: int = 4,
                     new_tokens: int = 24) -> list[TokenSequence]:
    """Random prompts followed by the target's greedy continuation (anchors after the prompt)."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, VOCAB - 1, (count, prompt_len), generator=g)
    with torch.no_grad():
        out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                             do_sample=False, max_new_tokens=new_tokens, pad_token_id=0)
    return [TokenSequence(tuple(row), prompt_len, "greedy") for row in out.tolist()]


def setup(block_size: int = 4, seed: int = 0, num_layers: int = 1):
    """(model, HFTarget capturing the drafter's layers, drafter)."""
    model = bigram_target()
    drafter = tiny_drafter(model, block_size=block_size, seed=seed, num_layers=num_layers,
                           target_layer_ids=[0, 2])
    return model, HFTarget(model, drafter.target_layer_ids), drafter
