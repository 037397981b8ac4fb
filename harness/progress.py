"""Progress of a long run on stderr: one line per event, or a live panel when stderr is a terminal and
``rich`` is installed (events still scroll above it)."""

from __future__ import annotations

import sys
import time

from harness.options import duration


def _clock(start: float, budget: float | None) -> str:
    """The time spent, and of what budget (None: a run without one)."""
    if budget is None:
        return f"[{duration(time.time() - start):>6}]"
    return f"[{duration(time.time() - start):>6}/{duration(budget)}]"


class LineProgress:
    """Plain lines, for logs and CI."""

    def __init__(self, start: float, budget: float | None, stream=None) -> None:
        self.start, self.budget, self.stream = start, budget, stream or sys.stderr

    def event(self, text: str) -> None:
        print(f"{_clock(self.start, self.budget)} {text}", file=self.stream, flush=True)

    def update(self, status: str, workers: list[str]) -> None:
        pass  # lines only on events: a CI log is read afterwards

    def close(self) -> None:
        pass


class LiveProgress(LineProgress):
    """A rich live panel: the sweep's totals and what each worker runs now."""

    def __init__(self, start: float, budget: float | None) -> None:
        from rich.console import Console
        from rich.live import Live

        super().__init__(start, budget)
        self.console = Console(stderr=True)
        self.live = Live(console=self.console, refresh_per_second=4, transient=True)
        self.live.start()

    def event(self, text: str) -> None:
        self.live.console.print(f"{_clock(self.start, self.budget)} {text}", markup=False, highlight=False)

    def update(self, status: str, workers: list[str]) -> None:
        from rich.text import Text

        self.live.update(Text("\n".join([f"{_clock(self.start, self.budget)} {status}", *workers])))

    def close(self) -> None:
        self.live.stop()


def make_progress(start: float, budget: float | None) -> LineProgress:
    if sys.stderr.isatty():
        try:
            return LiveProgress(start, budget)
        except ImportError:
            pass
    return LineProgress(start, budget)
