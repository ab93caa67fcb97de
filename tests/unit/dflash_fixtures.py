"""Tiny models for the DFlash tests: real HF targets built from a config, and stub models.

Stubs follow litgpt's style: a Markov-chain target whose logits depend only on the previous token,
and drafters whose proposals are fixed by construction (always / never / partly right).
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 128
# Tiny models gain nothing from threads, and on a busy 2-core machine spinning threads cost a lot.
torch.set_num_threads(1)


def tiny_target(family: str = "llama", *, seed: int = 0, layers: int = 4,
                attention: str | None = None):
    """A tiny random Llama or Qwen3 causal LM (float32, eval, the attention the engine runs in
    float32: dflash.attention's gqa_sdpa)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512, initializer_range=0.2, eos_token_id=None,
                  bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    if attention is None:
        from dflash_trt.dflash.attention import register_gqa

        attention = register_gqa()
    torch.manual_seed(seed)
    if family == "llama":
        config = LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        model = LlamaForCausalLM(config)
    else:
        config = Qwen3Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
        model = Qwen3ForCausalLM(config)
    model.config._attn_implementation = attention
    return model.eval()


def tiny_drafter(target, *, block_size: int = 4, num_layers: int = 1, seed: int = 0,
                 mask_token_id: int = VOCAB - 1, target_layer_ids=None):
    from dflash_trt.dflash.drafter_init import drafter_config_for_target, init_drafter

    config = drafter_config_for_target(target.config, num_layers=num_layers, block_size=block_size,
                                       target_layer_ids=target_layer_ids,
                                       mask_token_id=mask_token_id)
    return init_drafter(config, seed=seed)


def random_prompts(count: int, *, seed: int = 0, low: int = 3, high: int = 12) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g).tolist()
    return [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in lengths]


class LengthCache:
    """A cache that only tracks how many positions it holds (enough for the stubs)."""

    def __init__(self):
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, length: int) -> None:
        assert length <= self.length, "cropping may only shrink the cache"
        self.length = length


class StubTarget:
    """A Markov chain: logits of the next token are `log_probs[previous token]` (V x V)."""

    def __init__(self, log_probs: torch.Tensor):
        self.log_probs = log_probs  # (V, V)
        self.vocab = log_probs.shape[0]
        self.device = torch.device("cpu")
        self.forward_lengths: list[int] = []

    def new_cache(self) -> LengthCache:
        return LengthCache()

    def new_slot_cache(self, rows: int, capacity: int):
        from dflash_trt.dflash.slots import SlotCache

        return SlotCache(0, rows, capacity)  # the chain reads no cache

    def embed(self, ids):
        return torch.nn.functional.one_hot(ids, self.vocab).float()  # (B, T, V)

    def forward(self, ids, cache, capture):
        self.forward_lengths.append(ids.shape[1])
        if isinstance(cache, LengthCache):  # a SlotView (dflash.batch) keeps its own lengths
            cache.length += ids.shape[1]
        hidden = self.log_probs[ids]  # (B, T, V): "hidden" is already the logits
        return hidden, (self.embed(ids) if capture else None)

    @property
    def vocab_size(self) -> int:
        return self.vocab

    def logits(self, hidden):
        return hidden.float()

    def logits_rows(self, hidden, ids):
        return hidden.float()[..., ids]


def chain_target(vocab: int = 16) -> StubTarget:
    """A deterministic chain: after token t the target always says (t + 1) % vocab."""
    table = torch.full((vocab, vocab), -10.0)
    table[torch.arange(vocab), (torch.arange(vocab) + 1) % vocab] = 10.0
    return StubTarget(table)


class StubDrafter(nn.Module):
    """Drafts `last + 1, last + 2, ...` for its first `correct` drafts, then wrong tokens.

    With `logits` given instead, every draft position uses those fixed logits rows (B-1 x V).
    """

    draft_vocab = None  # drafts over the whole vocabulary unless a test sets a tensor of ids

    def __init__(self, vocab: int, *, correct: int = 10**9, logits: torch.Tensor | None = None):
        super().__init__()
        self.vocab, self.correct, self.fixed = vocab, correct, logits
        self.mask_token_id = vocab - 1
        self.context_lengths: list[int] = []

    def new_cache(self) -> LengthCache:
        return LengthCache()

    def new_slot_cache(self, rows: int, capacity: int):
        from dflash_trt.dflash.slots import SlotCache

        return SlotCache(0, rows, capacity)

    def forward_rows(self, noise_embedding, target_hidden, context_lengths, view):
        """dflash.batch's call: each row drafted as forward drafts it alone."""
        if noise_embedding is None:
            return None
        return torch.cat([self.forward(noise_embedding[r:r + 1], target_hidden[r:r + 1, :c],
                                       LengthCache())
                          for r, c in enumerate(context_lengths)])

    def forward(self, noise_embedding, target_hidden, cache):
        self.context_lengths.append(target_hidden.shape[1])
        cache.length += target_hidden.shape[1] + noise_embedding.shape[1]
        block = noise_embedding.shape[1]
        if self.fixed is not None:
            return torch.cat([torch.zeros(1, 1, self.vocab), self.fixed[None, :block - 1]], dim=1)
        last = int(noise_embedding[0, 0].argmax())
        out = torch.full((1, block, self.vocab), -10.0)
        for j in range(1, block):
            right = (last + j) % self.vocab
            out[0, j, right if j <= self.correct else (right + 1) % self.vocab] = 10.0
        return out


class OracleDrafter(nn.Module):
    """Drafts a known reference continuation through the real target's LM head, with planned misses.

    At each block, the number of correct drafts cycles through 0..B-1 so that every acceptance
    length occurs; the hidden state for token t is the LM-head row of t (argmax-checked).
    """

    draft_vocab = None

    def __init__(self, target, reference: list[int], block_size: int):
        super().__init__()
        self.reference, self.block_size = reference, block_size
        self.mask_token_id = VOCAB - 1
        self.rows = target.get_output_embeddings().weight.detach()  # (V, H)
        self.calls = 0
        scores = self.rows @ self.rows.T  # (V, V)
        assert bool((scores.argmax(dim=-1) == torch.arange(VOCAB)).all()), "LM head rows ambiguous"

    def new_cache(self) -> LengthCache:
        return LengthCache()

    def forward(self, noise_embedding, target_hidden, cache):
        start = cache.length + target_hidden.shape[1]  # position of the block's first token
        cache.length = start + noise_embedding.shape[1]
        correct = self.calls % self.block_size
        self.calls += 1
        out = torch.zeros(1, noise_embedding.shape[1], self.rows.shape[1])
        for j in range(1, noise_embedding.shape[1]):
            pos = start + j
            token = self.reference[pos] if pos < len(self.reference) else 0
            if j > correct:
                token = (token + 1) % (VOCAB - 1)
            out[0, j] = self.rows[token]
        return out


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<mask>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokenizer():
    """A byte-level tokenizer with no merges: every UTF-8 byte is a token (ids 4..259)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                  bos_token="<|im_start|>", unk_token="<|endoftext|>",
                                  additional_special_tokens=["<mask>"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def write_tiny_checkpoint(path, family: str = "llama", *, seed: int = 0):
    """A tiny target with a byte-level tokenizer saved as a plain HF checkpoint directory."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    tok = byte_tokenizer()
    vocab = len(tok)  # 260
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=512, initializer_range=0.2, eos_token_id=2,
                  bos_token_id=1, pad_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def write_tiny_drafter(target, path):
    """A new drafter for a tiny checkpoint (block size 4, reading target layers 0 and 2), made
    by the `init-drafter` command as a user would."""
    from click.testing import CliRunner

    from dflash_trt.commands.engine import COMMANDS

    command = {c.name: c for c in COMMANDS}["init-drafter"]
    result = CliRunner().invoke(command, ["--target", str(target), "--output", str(path),
                                          "--block-size", "4", "--target-layer-ids", "0,2",
                                          "--seed", "1"])
    assert result.exit_code == 0, result.output
    return path
