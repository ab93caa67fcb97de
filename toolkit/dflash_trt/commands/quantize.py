"""Checkpoint commands: `lint-checkpoint DIR [--drafter DIR]`."""

from __future__ import annotations

import click

_DIR = click.Path(exists=True, file_okay=False, dir_okay=True)


@click.command("lint-checkpoint")
@click.argument("checkpoint", type=_DIR)
@click.option("--drafter", type=_DIR, default=None,
              help="A DFlash drafter to lint too, and to check against CHECKPOINT as its target.")
@click.pass_context
def lint_checkpoint(ctx: click.Context, checkpoint: str, drafter: str | None) -> None:
    """Check that a (quantized) checkpoint holds what its config says; exit 1 on any finding.

    Checks every quantized layer's tensors, dtypes and shapes against hf_quant_config.json, the
    exclude list against what is stored, bytes on disk against the format, and with --drafter the
    drafter's fit to the target (hidden size, vocabulary, target layers, mask token, RoPE).
    """
    from dflash_trt.formats.lint import lint_pair

    findings = lint_pair(checkpoint, drafter)
    for finding in findings:
        click.echo(str(finding))
    if findings:
        ctx.exit(1)
    click.echo(f"{checkpoint}: clean" + (f" (drafter {drafter}: clean)" if drafter else ""))


COMMANDS = [lint_checkpoint]
