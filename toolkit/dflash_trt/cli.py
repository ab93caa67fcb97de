"""The `dflash-trt` command line. Thin: parse, call, print. Heavy modules load inside commands."""

from __future__ import annotations

import importlib
import json
import sys
import traceback

import click

from dflash_trt import __version__
from dflash_trt.errors import DflashTrtError, UsageError

# Modules under dflash_trt.commands that each export COMMANDS (lists of click commands).
COMMAND_MODULES = ("engine", "train", "quantize", "serve", "bench")


class Group(click.Group):
    """Turns unexpected exceptions into one line unless --debug; keeps command order."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.Abort):
            raise
        except click.ClickException:
            if (ctx.obj or {}).get("debug"):
                traceback.print_exc()
            raise
        except KeyboardInterrupt:
            raise click.Abort() from None
        except Exception as exc:
            if (ctx.obj or {}).get("debug"):
                raise
            raise DflashTrtError(f"internal error: {type(exc).__name__}: {exc} "
                                 "(rerun with --debug for the traceback)") from None


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="dflash-trt")
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """DFlash speculative decoding, from a recipe to a Triton model repository."""
    ctx.obj = {"debug": debug}


def _load_recipe(path: str):
    from dflash_trt.recipe import load_recipe

    return load_recipe(path)


@cli.command()
@click.argument("recipes", nargs=-1, required=True, type=click.Path(dir_okay=False))
def validate(recipes: tuple[str, ...]) -> None:
    """Check recipes without building anything (all errors at once)."""
    from dflash_trt.errors import RecipeError

    messages = []
    for path in recipes:
        try:
            recipe = _load_recipe(path)
            click.echo(f"ok  {path}  ({recipe.name}: {recipe.hardware}, {recipe.engine.backend}, "
                       f"target {recipe.quantize.target.format})")
        except RecipeError as exc:
            messages.append(exc.message)
    if messages:
        raise UsageError("\n".join(messages))


@cli.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan(recipe: str, as_json: bool) -> None:
    """Show each build stage: up to date, or why it would run."""
    from dflash_trt.stages.pipeline import plan as make_plan

    r = _load_recipe(recipe)
    rows = make_plan(r)
    if as_json:
        click.echo(json.dumps([{"stage": s, "up_to_date": why is None, "reason": why}
                               for s, why in rows], indent=2))
        return
    click.echo(f"build dir: {r.build_dir}")
    for stage, why in rows:
        click.echo(f"  {stage:<9} {'up to date' if why is None else 'will run: ' + why}")
    if r.engine.backend == "tensorrt_llm":
        from dflash_trt.stages.memory import memory_lines

        for line in memory_lines(r):
            click.echo(line)


@cli.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--force", multiple=True, metavar="STAGE", help="Rerun STAGE even if up to date.")
@click.option("--only", multiple=True, metavar="STAGE",
              help="Run only these stages (repeat or give several: --only compile emit).")
@click.option("--quiet", is_flag=True, help="No progress, no table.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
@click.argument("extra_only", nargs=-1, metavar="")
def build(recipe: str, force: tuple[str, ...], only: tuple[str, ...], quiet: bool,
          as_json: bool, extra_only: tuple[str, ...]) -> None:
    """Build a recipe: resolve, quantize, verify, compile, emit."""
    from dflash_trt.stages.progress import run_build

    if extra_only and not only:
        raise UsageError(f"unexpected argument {extra_only[0]!r}; stages go after --only")
    run_build(_load_recipe(recipe), only=only + extra_only, force=force, quiet=quiet,
              as_json=as_json)


@cli.command()
@click.option("--format", "fmt", type=click.Choice(["json", "markdown"]), default="json",
              show_default=True, help="JSON Schema for editors, or the Markdown reference.")
def schema(fmt: str) -> None:
    """Print the recipe schema."""
    from dflash_trt.recipe import recipe_json_schema

    if fmt == "markdown":
        from dflash_trt.recipe.reference import recipe_reference

        click.echo(recipe_reference(), nl=False)
    else:
        click.echo(json.dumps(recipe_json_schema(), indent=2))


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
def doctor(as_json: bool) -> None:
    """Check what this machine can build and serve, and what to do about what is missing."""
    from dflash_trt.doctor import print_report, run_checks

    checks = run_checks()
    if as_json:
        click.echo(json.dumps([c.__dict__ for c in checks], indent=2))
    else:
        print_report(checks)


def _register_command_modules() -> None:
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"dflash_trt.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"dflash_trt.commands.{name}":
                continue  # an area this version does not ship
            raise
        for command in module.COMMANDS:
            cli.add_command(command)


_register_command_modules()


def main() -> None:
    cli(prog_name="dflash-trt")


if __name__ == "__main__":
    sys.exit(main())

