"""A progress bar per run, for runs that train side by side (redrawn in place on a terminal).

Fed from the parent process by the runner's progress callback. On a terminal the block of bars is
redrawn at most every 0.2 s; otherwise (CI logs, pipes) one line is printed when a run starts, at
each quarter, and when it ends.
"""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO

WIDTH = 24


class MultiProgress:
    """Bars for `names` (each with `total` steps), written to `stream` (stderr by default)."""

    def __init__(self, names: list[str], total: int, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.names = list(names)
        self.state: dict[str, tuple[str, int, int, float]] = {
            n: ("waiting", 0, total, math.nan) for n in names
        }
        self.started: dict[str, float] = {}
        self.quarter: dict[str, int] = {}
        self.drawn = 0
        self.last = 0.0

    def update(self, run: str, status: str, step: int, total: int, loss: float) -> None:
        """Record progress of `run` (status: start, step, done, failed, interrupted) and redraw."""
        if run not in self.state:
            self.names.append(run)
        if status == "start":
            self.started[run] = time.perf_counter()
        self.state[run] = ("running" if status in ("start", "step") else status, step, total, loss)
        if self.tty:
            if status == "step" and time.perf_counter() - self.last < 0.2:
                return
            self._redraw()
        else:
            self._log(run, status, step, total, loss)

    def close(self) -> None:
        """Final redraw (terminal)."""
        if self.tty:
            self._redraw()

    def _line(self, run: str) -> str:
        status, step, total, loss = self.state[run]
        filled = int(WIDTH * step / total) if total else 0
        bar = "#" * filled + "-" * (WIDTH - filled)
        width = max(len(n) for n in self.names)
        elapsed = time.perf_counter() - self.started[run] if run in self.started else 0.0
        loss_text = (
            f"loss {loss:.3f}" if math.isfinite(loss) else ("loss nan" if math.isnan(loss) and step else "")
        )
        tail = "" if status == "running" else f"  {status}"
        return f"{run:<{width}} [{bar}] {step:>5}/{total:<5} {loss_text:<11} {elapsed:5.0f}s{tail}"

    def _redraw(self) -> None:
        out = self.stream
        if self.drawn:
            out.write(f"\x1b[{self.drawn}F")  # back to the first bar's line
        for run in self.names:
            out.write("\x1b[2K" + self._line(run) + "\n")
        self.drawn = len(self.names)
        out.flush()
        self.last = time.perf_counter()

    def _log(self, run: str, status: str, step: int, total: int, loss: float) -> None:
        quarter = 4 * step // total if total else 0
        if status == "step" and quarter <= self.quarter.get(run, 0):
            return
        self.quarter[run] = quarter
        self.stream.write(self._line(run) + ("" if status != "start" else "  started") + "\n")
        self.stream.flush()
