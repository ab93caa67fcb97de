"""The recipe reference (docs/recipe.md), generated from the schema so it cannot drift."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import BaseModel

from dflash_trt.recipe import Recipe

HEADER = """# Recipe reference

Generated from the schema by `dflash-trt schema --format markdown`; a test keeps it current.
Unknown keys are errors. Relative paths resolve against the recipe file's directory.
Shipped examples are in `recipes/`. Cross-field rules:

- `nvfp4` (or `w4a16_nvfp4`) served by `tensorrt_llm` needs `hardware: sm100` or `sm103`;
  on Hopper (`sm90`) use `fp8`. An `nvfp4` KV cache has the same rule.
- `engine.backend: tensorrt_llm` needs a GPU `hardware`; `tensor_parallel_size > 1` needs it too.
- `engine.build_path: trtllm_build` is refused: TensorRT-LLM removed that path in 2026 and its C++
  runtime never had a DFlash mode.
- `drafter` takes exactly one of `source` (an existing drafter) or `init` (a new one).
"""


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return "section"
        return getattr(annotation, "__name__", str(annotation))
    args = [a for a in get_args(annotation) if a is not type(None)]
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in get_args(annotation))
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"map of {_type_name(args[0])} to {_type_name(args[1])}"
    if origin is Annotated:
        return _type_name(args[0])
    return " or ".join(_type_name(a) for a in args)


def _default(field: Any) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        return "see below" if isinstance(field.default_factory(), BaseModel) else \
            f"`{field.default_factory()}`"
    return f"`{field.default}`"


def _section(model: type[BaseModel], prefix: str, out: list[str]) -> None:
    nested = []
    out.append(f"\n## `{prefix or '(top level)'}`\n")
    out.append("| key | type | default | description |\n|---|---|---|---|")
    for name, field in model.model_fields.items():
        out.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | "
                   f"{field.description} |")
        for arg in (field.annotation, *get_args(field.annotation)):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                nested.append((arg, f"{prefix}.{name}" if prefix else name))
    for sub, path in nested:
        _section(sub, path, out)


def recipe_reference() -> str:
    out = [HEADER]
    _section(Recipe, "", out)
    return "\n".join(out) + "\n"
