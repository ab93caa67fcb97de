"""Loading a recipe: safe YAML with positions, then validation with every problem reported at once.

The YAML loader is safe (no tags), refuses duplicate keys and alias bombs, and keeps each key's
line and column so that every finding reads `FILE:LINE:COL: dotted.path: what is wrong; what to do`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from dflash_trt.errors import RecipeError
from dflash_trt.recipe.schema import CrossFieldErrors, Recipe

MAX_YAML_NODES = 20_000  # far above any real recipe; stops alias bombs before they expand


# --- YAML with positions --------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                mark = key_node.start_mark
                raise _YamlProblem(mark.line + 1, mark.column + 1,
                                   f"duplicate key {key!r} (first at line "
                                   f"{seen[key].start_mark.line + 1}); keep one")
            seen[key] = key_node
        return super().construct_mapping(node, deep)


class _YamlProblem(Exception):
    def __init__(self, line: int, column: int, message: str):
        super().__init__(message)
        self.line, self.column, self.message = line, column, message


def _count_nodes(node: yaml.Node, memo: dict[int, int], active: set[int]) -> int:
    """Nodes after alias expansion, computed without expanding (memoized on shared nodes)."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in active:
        raise _YamlProblem(node.start_mark.line + 1, node.start_mark.column + 1,
                           "recursive alias; recipes cannot refer to themselves")
    active.add(key)
    total = 1
    if isinstance(node, yaml.SequenceNode):
        total += sum(_count_nodes(child, memo, active) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        total += sum(_count_nodes(k, memo, active) + _count_nodes(v, memo, active)
                     for k, v in node.value)
    active.discard(key)
    memo[key] = min(total, MAX_YAML_NODES + 1)
    if memo[key] > MAX_YAML_NODES:
        raise _YamlProblem(node.start_mark.line + 1, node.start_mark.column + 1,
                           f"YAML expands to more than {MAX_YAML_NODES} nodes (alias bomb?); "
                           "write the recipe out plainly")
    return memo[key]


def _positions(node: yaml.Node, path: tuple = (), out: dict | None = None) -> dict:
    """Map each dotted path (tuple) to the (line, column) of its key or item, 1-based."""
    out = {} if out is None else out
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            sub = (*path, k.value)
            out.setdefault(sub, (k.start_mark.line + 1, k.start_mark.column + 1))
            _positions(v, sub, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            sub = (*path, i)
            out.setdefault(sub, (v.start_mark.line + 1, v.start_mark.column + 1))
            _positions(v, sub, out)
    return out


def parse_yaml(text: str) -> tuple[Any, dict]:
    """Parse safely; return (data, positions). Raises _YamlProblem with a position."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise _YamlProblem(1, 1, "the file is empty; start from a shipped recipe in recipes/")
        _count_nodes(node, {}, set())
        data = loader.construct_document(node)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        raise _YamlProblem(line, col, f"invalid YAML: {exc.problem or exc}") from None
    finally:
        loader.dispose()
    return data, _positions(node)


# --- loading --------------------------------------------------------------------------------


def _friendly(err: dict, model_fields: list[str] | None) -> str:
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        valid = f"; valid keys here: {', '.join(model_fields)}" if model_fields else ""
        return f"unknown key{valid}"
    if kind == "missing":
        return "required key is missing; add it"
    msg = msg.removeprefix("Value error, ")
    value = err.get("input")
    if kind != "value_error" and isinstance(value, (str, int, float, bool)):
        return f"{msg} (got {value!r})"
    return msg


def _fields_at(loc: tuple) -> list[str] | None:
    model: Any = Recipe
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        ann = field.annotation
        model = next((a for a in getattr(ann, "__args__", (ann,))
                      if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if model is None:
            return None
    return list(getattr(model, "model_fields", {}))


def _locate(loc: tuple, positions: dict) -> tuple[int, int]:
    for end in range(len(loc), 0, -1):
        if loc[:end] in positions:
            return positions[loc[:end]]
    return (1, 1)


def _dotted(loc: tuple) -> str:
    return ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc).replace(".[", "[") \
        or "(root)"


def load_recipe(path: str | Path) -> Recipe:
    """Load and validate a recipe; raise RecipeError listing every problem with its position."""
    path = Path(path)
    label = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(label, [f"{label}: file not found; check the path"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(label, [f"{label}: cannot read: {exc}"]) from None
    try:
        data, positions = parse_yaml(text)
    except _YamlProblem as p:
        raise RecipeError(label, [f"{label}:{p.line}:{p.column}: {p.message}"]) from None
    if not isinstance(data, dict):
        raise RecipeError(label, [f"{label}:1:1: (root): the recipe must be a mapping of "
                                  f"sections, got {type(data).__name__}; see recipes/ for examples"])
    return validate_recipe(data, label, positions, base_dir=path.resolve().parent)


def validate_recipe(data: dict, label: str = "<recipe>", positions: dict | None = None,
                    base_dir: Path | None = None) -> Recipe:
    """Validate parsed recipe data; relative paths resolve against base_dir."""
    positions = positions or {}
    context = {"base_dir": str(base_dir or Path.cwd())}
    try:
        return Recipe.model_validate(data, context=context)
    except ValidationError as exc:
        findings: set[tuple[int, int, str]] = set()
        for err in exc.errors():
            loc = tuple(err["loc"])
            cross = (err.get("ctx") or {}).get("error")
            if isinstance(cross, CrossFieldErrors):
                for sub in cross.errors:
                    line, col = _locate(sub.loc, positions)
                    findings.add((line, col, f"{_dotted(sub.loc)}: {sub}"))
                continue
            line, col = _locate(loc, positions)
            fields = _fields_at(loc) if err["type"] == "extra_forbidden" else None
            findings.add((line, col, f"{_dotted(loc)}: {_friendly(err, fields)}"))
        raise RecipeError(label, [f"{label}:{line}:{col}: {text}"
                                  for line, col, text in sorted(findings)]) from None
