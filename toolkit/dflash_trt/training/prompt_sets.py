"""Built-in prompt sets written from the running Python's standard library (no external data).

- `builtin:code-prompts`: per documented stdlib function, one of three forms in turn (a bare
  signature-and-docstring stub to complete, the stub with an instruction, a one-line "write a
  function" request from the docstring), as HumanEval presents tasks;
- `builtin:method-prompts`: the same for documented methods of public stdlib classes;
- `builtin:restated-prompts`: the same tasks in the two forms the sets above did not use.

Deterministic for a given Python version (fixed file order and shuffles).
"""

from __future__ import annotations

import ast
import functools
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

from dflash_trt.prompts import CODE_PROMPTS, METHOD_PROMPTS, RESTATED_PROMPTS

# Test suites and vendored third-party code are not "the standard library as users write it".
STDLIB_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "lib2to3",
                    "ensurepip", "turtledemo"}


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


def _forms(nodes, forms, seed: int, offsets: Sequence[int] = (0,)) -> tuple[str, ...]:
    """Prompts per (owner, node) of `forms(owner, node, stub, first sentence)` (three forms):
    for offset o, node i takes form (i + o) % 3; then a fixed shuffle so that any prefix of the
    list (a partial run) spans many modules."""
    import random

    prompts = []
    for i, (owner, node) in enumerate(nodes):
        first = _short_doc(ast.get_docstring(node), 300).split("\n\n")[0].replace("\n", " ")
        written = forms(owner, node, _stub(node), first)
        prompts.extend(written[(i + o) % 3] for o in offsets)
    random.Random(seed).shuffle(prompts)
    return tuple(prompts)


def _function_forms(module, node, stub, first):
    return (stub, f"Complete the following Python function.\n\n{stub}",
            f"Write a Python function `{node.name}` (like {module}.{node.name}). {first}")


def _method_forms(cls, node, stub, first):
    return (f"Complete this method of the Python class `{cls}`.\n\n{stub}",
            f"Write the method `{cls}.{node.name}` in Python.\n\n{stub}",
            f"Write a Python function `{node.name}`. {first}")


@functools.cache
def _prompt_set(kind: str) -> tuple[str, ...]:
    if kind == CODE_PROMPTS:
        return _forms(_stdlib_functions(), _function_forms, seed=0)
    if kind == METHOD_PROMPTS:
        return _forms(_stdlib_methods(), _method_forms, seed=1)
    other = (1, 2)  # the two forms the sets above did not use, for each of their tasks
    seen = set(_prompt_set(CODE_PROMPTS)) | set(_prompt_set(METHOD_PROMPTS))
    kept = []
    for prompt in _forms(_stdlib_functions(), _function_forms, 2, other) + \
            _forms(_stdlib_methods(), _method_forms, 3, other):
        if prompt not in seen:  # a same-named method's one-line request may repeat itself
            seen.add(prompt)
            kept.append(prompt)
    return tuple(kept)


def code_prompts() -> list[str]:
    """HumanEval-style prompts written from standard-library functions (deterministic order):
    a bare stub to complete, a stub with an instruction, a one-line request from the docstring."""
    return list(_prompt_set(CODE_PROMPTS))


def method_prompts() -> list[str]:
    """Prompts written from standard-library class methods, in code_prompts' three forms."""
    return list(_prompt_set(METHOD_PROMPTS))


def restated_prompts() -> list[str]:
    """The tasks of code_prompts and method_prompts in the two forms those sets did not use
    (about 8,300 prompts, none in those sets or repeated): new text on the same standard library;
    functions first, then methods, each shuffled."""
    return list(_prompt_set(RESTATED_PROMPTS))
