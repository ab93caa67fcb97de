"""User-facing errors: one line that says what is wrong and how to fix it.

Every failure a user can cause or fix is a DflashTrtError, so the CLI prints one clean line and
picks the exit code; tracebacks are shown only with --debug.
"""

from __future__ import annotations

import click


class DflashTrtError(click.ClickException):
    """A failure the user can act on (exit code 1)."""

    exit_code = 1

    def format_message(self) -> str:
        return self.message


class UsageError(DflashTrtError):
    """Bad input from the user: a flag, a file, a recipe (exit code 2)."""

    exit_code = 2


class RecipeError(UsageError):
    """A recipe that does not validate. Carries every finding, not just the first."""

    def __init__(self, path: str, findings: list[str]):
        self.findings = findings
        noun = "error" if len(findings) == 1 else "errors"
        super().__init__(f"{path}: {len(findings)} {noun}\n" + "\n".join(findings))


class NotImplementedStage(DflashTrtError):
    """A pipeline stage that this version cannot run yet; never pretend it ran."""
