"""`LoggedProgress`: plain lines where rich cannot draw (a log file, a Kubernetes Job), none on a
terminal."""

from __future__ import annotations

import io

from rich.console import Console
from rich.progress import TextColumn

from dflash_trt.commands.progress_lines import LoggedProgress


def _progress(buf: io.StringIO, *, terminal: bool, every: float) -> LoggedProgress:
    console = Console(file=buf, force_terminal=terminal, width=200)
    return LoggedProgress(TextColumn("{task.description}"), console=console, every=every,
                          auto_refresh=False)


def test_a_log_gets_a_line_per_interval_and_one_when_a_task_finishes():
    buf = io.StringIO()
    with _progress(buf, terminal=False, every=0) as progress:
        task = progress.add_task("target features", total=1000, info="")
        progress.advance(task, 250)
        progress.update(task, completed=1000, info="loss 3.250")
        progress.advance(task, 0)  # after its final line, a finished task stays quiet
    lines = [line for line in buf.getvalue().splitlines() if "target features:" in line]
    assert len(lines) == 2
    assert "250/1,000 (25%)" in lines[0]
    assert "1,000/1,000 (100%)" in lines[1] and "loss 3.250" in lines[1]


def test_between_intervals_only_the_finishing_line_is_written():
    buf = io.StringIO()
    with _progress(buf, terminal=False, every=3600) as progress:
        task = progress.add_task("training", total=10, info="")
        for _ in range(10):
            progress.advance(task)
    lines = [line for line in buf.getvalue().splitlines() if "training:" in line]
    assert len(lines) == 1 and "10/10 (100%)" in lines[0]


def test_a_terminal_gets_the_live_display_and_no_lines():
    buf = io.StringIO()
    with _progress(buf, terminal=True, every=0) as progress:
        task = progress.add_task("training", total=10, info="")
        progress.advance(task, 5)
    assert "5/10" not in buf.getvalue()
