"""A rich progress display that also writes plain lines when its console is not a terminal.

Under nohup, a Kubernetes Job or CI, rich draws nothing until the work ends, so an hour of target
features and training would leave an empty log. There each task logs a line at most every
`every` seconds, and once when it finishes.
"""

from __future__ import annotations

import time

from rich.progress import Progress, TaskID


class LoggedProgress(Progress):
    def __init__(self, *columns, every: float = 60.0, **kwargs):
        super().__init__(*columns, **kwargs)
        self.every = every
        self._logged: dict[TaskID, float] = {}  # task -> when its last line was written
        self._finished: set[TaskID] = set()

    def update(self, task_id: TaskID, **kwargs) -> None:
        super().update(task_id, **kwargs)
        self._maybe_log(task_id)

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        self._maybe_log(task_id)

    def _maybe_log(self, task_id: TaskID) -> None:
        if self.disable or self.console.is_terminal or task_id in self._finished:
            return
        task = next(t for t in self.tasks if t.id == task_id)
        if not task.visible:
            return
        now = time.monotonic()
        last = self._logged.setdefault(task_id, now)
        done = task.total is not None and task.completed >= task.total
        if not done and now - last < self.every:
            return
        self._logged[task_id] = now
        if done:
            self._finished.add(task_id)
        of = f"/{task.total:,.0f} ({100 * task.completed / task.total:.0f}%)" if task.total else ""
        info = task.fields.get("info", "")
        minutes, seconds = divmod(int(task.elapsed or 0), 60)
        self.console.log(f"{task.description}: {task.completed:,.0f}{of}"
                         + (f"  {info}" if info else "") + f"  {minutes}:{seconds:02d} elapsed")
