"""The package's layout, checked from its source (AST only, nothing imported).

One folder per concern, imports flowing one way (README.md, "Layout"): no import cycle, counting
imports inside functions and modules named in strings (the pipeline's "module:function" stages);
no module over 500 lines; at most 6 loose modules at the package top; the layers never import
upwards; and pyproject.toml ships every package folder.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "dflash_trt"
# Folders outside toolkit/ that pyproject.toml maps into the package (setuptools package-dir).
MAPPED = {f"{PACKAGE}.plugins.dflash": ROOT / "plugins" / "dflash"}
MAX_LINES = 500
MAX_LOOSE = 6
# Layer rules: a package (or loose module) never imports the ones named here.
FORBIDDEN = {
    "dflash": ("stages", "commands", "engines", "serving", "bench", "training", "recipe", "formats"),
    "formats": ("stages", "commands", "engines", "serving", "bench", "training"),
    "engines": ("stages", "commands", "serving", "bench", "training"),
    "training": ("stages", "commands", "engines", "serving", "bench"),
    "serving": ("stages", "commands", "bench", "training"),
    "bench": ("commands",),
    "stages": ("commands", "serving", "bench"),
    "recipe": ("stages", "commands", "dflash", "engines", "formats", "serving", "bench",
               "training", "plugins"),
    "plugins": ("stages", "commands", "dflash", "engines", "formats", "serving", "bench",
                "training", "recipe"),
    # The loose modules everything may use import nothing of the package's layers.
    "prompts": ("stages", "commands", "dflash", "engines", "formats", "serving", "bench",
                "training", "recipe", "plugins", "cli", "doctor"),
    "errors": ("stages", "commands", "dflash", "engines", "formats", "serving", "bench",
               "training", "recipe", "plugins", "cli", "doctor", "prompts"),
}


def package_modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    roots = {PACKAGE: ROOT / "toolkit" / PACKAGE, **MAPPED}
    modules: dict[str, Path] = {}
    for prefix, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if "__pycache__" in parts or not all(p.isidentifier() for p in parts):
                continue  # not importable as a module (e.g. a template's 1/model.py)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((prefix, *parts))] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package modules `name` imports anywhere in its file (functions included)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join(here + ([node.module] if node.module else []))
            # `from pkg import mod` imports pkg.mod; `from mod import name` imports mod.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.startswith(f"{PACKAGE}."):
            targets = [node.value.split(":")[0]]  # importlib by name: "pkg.module:function"
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    # engines/__init__ imports the torch engine inside load_engine; the plugin imports `.ops`;
    # the pipeline names its stages' modules in strings.
    assert f"{PACKAGE}.engines.torch_engine" in graph[f"{PACKAGE}.engines"]
    assert f"{PACKAGE}.plugins.dflash.ops" in graph[f"{PACKAGE}.plugins.dflash"]
    assert f"{PACKAGE}.stages.emit" in graph[f"{PACKAGE}.stages.pipeline"]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_layers_never_import_upwards():
    bad = []
    for name, targets in import_graph().items():
        parts = name.split(".")
        if len(parts) < 2 or parts[1] not in FORBIDDEN:
            continue  # the package's own __init__ only
        for target in targets:
            layer = target.split(".")[1] if target.count(".") else None
            if layer in FORBIDDEN[parts[1]]:
                bad.append(f"{name} -> {target}")
    assert bad == []


def test_no_module_over_500_lines():
    long = {name: n for name, path in package_modules().items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert long == {}


def test_few_loose_modules_at_the_package_top():
    loose = sorted(p.name for p in (ROOT / "toolkit" / PACKAGE).glob("*.py"))
    assert len(loose) <= MAX_LOOSE, loose


def test_no_folder_is_named_like_a_build_output():
    # pytest (norecursedirs), ruff (exclude) and .gitignore skip these names: a package or test
    # folder called build/ is silently not collected, not linted and not committed.
    skipped = {"build", "dist", "venv", "node_modules", "_build", "site-packages"}
    tops = [ROOT / name for name in ("toolkit", "tests", "plugins", "triton_repo", "scripts")]
    folders = [p for top in tops for p in top.rglob("*")
               if p.is_dir() and "__pycache__" not in p.parts]
    assert [p for p in folders if p.name in skipped] == []


def test_unit_tests_mirror_the_package():
    package = {p.name for p in (ROOT / "toolkit" / PACKAGE).iterdir() if p.is_dir()} - {"__pycache__"}
    tests = {p.name for p in (ROOT / "tests" / "unit").iterdir() if p.is_dir()} - {"__pycache__"}
    assert tests <= package, sorted(tests - package)


def test_pyproject_ships_every_package_folder():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {name for name, path in package_modules().items() if path.name == "__init__.py"}
    assert sorted(config["packages"]) == sorted(folders)
    assert {k: ROOT / v for k, v in config["package-dir"].items() if k} == MAPPED
    # Every folder holding Python modules is a package (has __init__.py), or it would not ship.
    roots = [ROOT / "toolkit" / PACKAGE, *MAPPED.values()]
    code_dirs = {p.parent for root in roots for p in root.rglob("*.py")
                 if "__pycache__" not in p.parts and "triton_repo" not in p.parts}
    assert [d for d in code_dirs if not (d / "__init__.py").is_file()] == []
