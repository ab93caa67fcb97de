"""`dflash-trt build` on a terminal: progress while stages run, a summary table at the end."""

from __future__ import annotations

import json
from collections.abc import Sequence

import click

from dflash_trt.errors import DflashTrtError
from dflash_trt.recipe import Recipe
from dflash_trt.stages.pipeline import StageResult, read_manifest, run_pipeline


def run_build(recipe: Recipe, *, only: Sequence[str] = (), force: Sequence[str] = (),
              quiet: bool = False, as_json: bool = False) -> list[StageResult]:
    """Run the pipeline with progress and a summary; re-raise a failing stage's error."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    results: list[StageResult] = []
    show = not quiet and not as_json
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                        TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                        console=console, transient=True, disable=not show)

    def on_result(result: StageResult) -> None:
        results.append(result)
        if show:
            note = result.note or (f"{result.seconds:.1f}s" if result.status == "ok" else "")
            console.print(f"[bold]{result.name:<9}[/] {result.status:<8} {note}")

    error: DflashTrtError | None = None
    try:
        with progress:
            run_pipeline(recipe, only=only, force=force, rich_progress=progress if show else None,
                         on_result=on_result)
    except DflashTrtError as exc:
        error = exc
    except KeyboardInterrupt:
        error = DflashTrtError("interrupted; the stage that was running left no output behind")
    manifest = read_manifest(recipe.build_dir)
    failed = _failed_stage(manifest, results)
    if failed:
        results.append(failed)
    if as_json:
        click.echo(json.dumps({
            "recipe": recipe.name, "build_dir": str(recipe.build_dir),
            "ok": error is None,
            "stages": [r.__dict__ for r in results],
        }, indent=2, default=str))
    elif show:
        _print_table(console, recipe, results)
    if error is not None:
        stage = f"stage {failed.name} " if failed else ""
        raise type(error)(f"build stopped: {stage}{error.message}")
    if not quiet and not as_json:
        console.print(f"build ok: {recipe.build_dir}")
    return results


def _failed_stage(manifest: dict, results: list[StageResult]) -> StageResult | None:
    done = {r.name for r in results}
    for name, entry in manifest.get("stages", {}).items():
        if name not in done and entry.get("status") not in (None, "ok"):
            return StageResult(name, entry["status"], entry.get("seconds", 0.0),
                               note=entry.get("error", ""))
    return None


def _print_table(console, recipe: Recipe, results: list[StageResult]) -> None:
    from rich.table import Table

    table = Table(title=f"{recipe.name} -> {recipe.build_dir}")
    for col in ("stage", "status", "seconds", "note"):
        table.add_column(col)
    for r in results:
        table.add_row(r.name, r.status, f"{r.seconds:.1f}", r.note[:120])
    console.print(table)



