"""Progress bars of the worker's long jobs, drawn with rich.

Distillation, head training, kernel tuning and start-up calibration each
take seconds to tens of minutes on a CPU; each shows one bar with its count,
elapsed and remaining time, and the job's latest figures (a loss, say). On
a terminal the bar redraws in place; written to a file or pipe (a job under
nohup, CI) it prints its line every ``log_every_s`` seconds and once at the
end, since rich draws a non-terminal bar only when it stops. A disabled bar
draws nothing and costs a method call.

>>> bar = ProgressBar(3, "example", enabled=False)
>>> bar.update(2).show(loss=0.25).completed
2
>>> bar.close()
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn,
                           TimeRemainingColumn)

__all__ = ["ProgressBar"]


class ProgressBar:
    """One rich bar over ``total`` units of work.

    Parameters
    ----------
    total
        Units of work (prompts, steps, shapes); at least 0.
    description
        What the bar counts, shown on its left.
    enabled
        False draws nothing (logs, tests, a caller that shows its own display).
    console
        Where to draw (default: rich's console on standard output).
    log_every_s
        Off a terminal, seconds between printed progress lines.
    """

    def __init__(self, total: int, description: str, enabled: bool = True, console: Console | None = None,
                 log_every_s: float = 60.0) -> None:
        if total < 0:
            raise ValueError(f"progress total must be >= 0, got total={total}")
        if log_every_s < 0:
            raise ValueError(f"log_every_s must be >= 0, got log_every_s={log_every_s}")
        self.completed = 0
        self._log_every_s = log_every_s
        self._last_log = time.monotonic()
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        if enabled:
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                                      TextColumn("{task.fields[figures]}"), console=console)
            self._task = self._progress.add_task(description, total=total, figures="")
            self._progress.start()

    def update(self, n: int = 1) -> "ProgressBar":
        """Count ``n`` more units done."""
        self.completed += n
        if self._progress is not None:
            self._progress.update(self._task, advance=n)
            now = time.monotonic()
            if not self._progress.console.is_terminal and now - self._last_log >= self._log_every_s:
                self._last_log = now
                self._progress.console.print(self._line(), soft_wrap=True, highlight=False)
        return self

    def _line(self) -> str:
        """The bar as one plain line (a log file is no wider than its longest line)."""
        task = self._progress.tasks[0]
        eta = "?" if task.time_remaining is None else f"{task.time_remaining:.0f} s"
        return (f"{task.description}: {task.completed:.0f}/{task.total:.0f} ({task.percentage:.0f} %), "
                f"{task.elapsed or 0:.0f} s elapsed, eta {eta} {task.fields['figures']}").rstrip()

    def show(self, **figures: object) -> "ProgressBar":
        """Show ``name=value`` figures beside the bar (replacing the last ones)."""
        if self._progress is not None:
            self._progress.update(self._task, figures=" ".join(f"{k}={v}" for k, v in figures.items()))
        return self

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
