"""Progress on stderr: a bar per run for runs that train side by side (`MultiProgress`), and one
counted phase of a long command (`Phase`: bench rounds, bench memory processes, reading a log).

On a terminal the bars / the line are redrawn in place; otherwise (CI logs, pipes) plain lines are
printed, a few per run or phase, so a log shows where a long command is. Imports nothing heavy.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

WIDTH = 24


class MultiProgress:
    """Bars for `names` (each with `total` steps), written to `stream` (stderr by default).

    Below the bars an overall line counts the finished runs and estimates the time left from the
    steps done so far (all runs together, so parallel workers are accounted for). On a terminal
    shorter than the block, the running and latest finished runs are shown and the rest counted.
    Without a terminal each run prints a line when it starts, at each quarter and when it ends;
    the overall line follows each end.
    """

    def __init__(self, names: list[str], total: int, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.names = list(names)
        self.state: dict[str, tuple[str, int, int, float]] = {
            n: ("waiting", 0, total, math.nan) for n in names
        }
        self.started: dict[str, float] = {}
        self.ended: dict[str, float] = {}
        self.quarter: dict[str, int] = {}
        self.drawn = 0
        self.last = 0.0

    def update(self, run: str, status: str, step: int, total: int, loss: float) -> None:
        """Record progress of `run` (status: start, step, done, failed, interrupted) and redraw."""
        if run not in self.state:
            self.names.append(run)
        now = time.perf_counter()
        if status == "start":
            self.started[run] = now
        elif status not in ("step", "waiting"):
            self.ended.setdefault(run, now)
            self.started.setdefault(run, now)
        self.state[run] = ("running" if status in ("start", "step") else status, step, total, loss)
        if self.tty:
            if status == "step" and now - self.last < 0.2:
                return
            self._redraw()
        else:
            self._log(run, status, step, total, loss)

    def close(self) -> None:
        """Final redraw (terminal)."""
        if self.tty:
            self._redraw()

    def time_left(self) -> float | None:
        """Seconds left for every run, from the rate of steps so far (None before any step)."""
        if not self.started:
            return None
        total = done = 0
        for run in self.names:
            _, step, steps, _ = self.state[run]
            total += steps
            done += steps if run in self.ended else step  # a run that ended early leaves no work
        elapsed = time.perf_counter() - min(self.started.values())
        if done <= 0 or elapsed <= 0:
            return None
        return (total - done) * elapsed / done

    def overall(self) -> str:
        """'3/12 runs finished, 1m10s elapsed, ~3m20s left'."""
        finished = sum(run in self.ended for run in self.names)
        elapsed = time.perf_counter() - min(self.started.values()) if self.started else 0.0
        left = self.time_left()
        if finished == len(self.names):
            tail = "done"
        else:
            tail = "estimating time left" if left is None else f"~{duration(left)} left"
        return f"{finished}/{len(self.names)} runs finished, {duration(elapsed)} elapsed, {tail}"

    def _line(self, run: str) -> str:
        status, step, total, loss = self.state[run]
        filled = int(WIDTH * step / total) if total else 0
        bar = "#" * filled + "-" * (WIDTH - filled)
        width = max(len(n) for n in self.names)
        end = self.ended.get(run, time.perf_counter())
        elapsed = end - self.started[run] if run in self.started else 0.0
        loss_text = (
            f"loss {loss:.3f}" if math.isfinite(loss) else ("loss nan" if math.isnan(loss) and step else "")
        )
        tail = "" if status == "running" else f"  {status}"
        return f"{run:<{width}} [{bar}] {step:>5}/{total:<5} {loss_text:<11} {elapsed:5.0f}s{tail}"

    def _visible(self, rows: int) -> tuple[list[str], str]:
        """The runs to draw in `rows` lines (in their order) and a note on those left out."""
        if len(self.names) <= rows:
            return self.names, ""
        running = [n for n in self.names if self.state[n][0] == "running"]
        finished = sorted((n for n in self.names if n in self.ended), key=lambda n: self.ended[n])
        keep = set(running[:rows])
        keep.update(finished[::-1][: max(0, rows - len(keep))])
        waiting = [n for n in self.names if n not in keep and n not in self.ended]
        keep.update(waiting[: max(0, rows - len(keep))])
        hidden_waiting = sum(1 for n in self.names if n not in keep and n not in self.ended)
        hidden_done = sum(1 for n in self.names if n not in keep and n in self.ended)
        return [n for n in self.names if n in keep], (
            f"  (not shown: {hidden_waiting} waiting, {hidden_done} finished)"
        )

    def _redraw(self) -> None:
        import shutil

        out = self.stream
        rows = max(3, shutil.get_terminal_size((100, 24)).lines - 2)
        runs, hidden = self._visible(rows - 1)
        if self.drawn:
            out.write(f"\x1b[{self.drawn}F\x1b[J")  # back to the first bar's line, clear below
        for run in runs:
            out.write("\x1b[2K" + self._line(run) + "\n")
        out.write("\x1b[2K" + self.overall() + hidden + "\n")
        self.drawn = len(runs) + 1
        out.flush()
        self.last = time.perf_counter()

    def _log(self, run: str, status: str, step: int, total: int, loss: float) -> None:
        quarter = 4 * step // total if total else 0
        if status == "step" and quarter <= self.quarter.get(run, 0):
            return
        self.quarter[run] = quarter
        text = self._line(run) + ("" if status != "start" else "  started")
        if run in self.ended and len(self.names) > 1:
            text += "\n  " + self.overall()
        self.stream.write(text + "\n")
        self.stream.flush()


def duration(seconds: float) -> str:
    """12s, 3m05s, 1h02m."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class Phase:
    """Progress of one phase of a long command, counted in units (steps, processes, bytes).

    On a terminal: one live line (bar, count, what runs now, time elapsed and left), redrawn on
    each update (at most every 0.2 s) and once a second by a ticker thread, so the clock moves
    during a long unit. Otherwise (CI logs, pipes): plain lines — one when the phase starts, one
    per finished unit with `log_units` (else one at each quarter), one per `begin` with
    `log_items`, and one when it ends.

    `eta(done)` gives the seconds left as judged right after `done` units finished (None: unknown);
    by default the rate so far. `fmt` writes a count (e.g. bytes as MiB).
    """

    def __init__(
        self,
        label: str,
        total: int,
        *,
        stream: TextIO | None = None,
        log_units: bool = False,
        log_items: bool = False,
        eta: Callable[[int], float | None] | None = None,
        fmt: Callable[[int], str] = str,
        unit: str = "",
        tick: bool = True,
    ) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.label, self.total, self.done = label, max(0, total), 0
        self.log_units, self.log_items, self.eta, self.fmt = log_units, log_items, eta, fmt
        self.unit = f" {unit}" if unit else ""
        self.item = ""
        self.started = self.updated = time.perf_counter()
        self.left: float | None = None
        self.quarter = 0
        self.last_draw = 0.0
        self.closed = False
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.ticker: threading.Thread | None = None
        if self.tty:
            self._draw(force=True)
            if tick:
                self.ticker = threading.Thread(target=self._tick, name="stabkit-progress", daemon=True)
                self.ticker.start()
        else:
            self._line(f"{label}: started ({self.fmt(self.total)}{self.unit} to do)")

    def __enter__(self) -> Phase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def begin(self, item: str) -> None:
        """Say what runs now (shown on the live line and in the next plain line)."""
        with self.lock:
            self.item = item
        if self.tty:
            self._draw(force=True)
        elif self.log_items:
            self._line(f"{self.label}: {item} ({self._count()}, {self._clock()})")

    def update(self, n: int = 1) -> None:
        """`n` more units are done."""
        now = time.perf_counter()
        with self.lock:
            self.done = min(self.total, self.done + n)
            self.updated = now
            if self.eta is not None:
                self.left = self.eta(self.done)
            elif self.done:
                self.left = (now - self.started) / self.done * (self.total - self.done)
        if self.tty:
            self._draw()
            return
        quarter = 4 * self.done // self.total if self.total else 4
        if self.log_units or quarter > self.quarter:
            self.quarter = quarter
            finished = f", finished {self.item}" if self.item else ""
            self._line(f"{self.label}: {self._count()}{finished} ({self._clock()})")

    def time_left(self) -> float | None:
        """Seconds left now: the last estimate less the time since it was made (None: unknown)."""
        if self.left is None:
            return None
        return max(0.0, self.left - (time.perf_counter() - self.updated))

    def close(self) -> None:
        """End the phase: stop the ticker, finish the live line or print the closing line."""
        if self.closed:
            return
        self.closed = True
        self.stop.set()
        if self.ticker is not None:
            self.ticker.join()
        elapsed = duration(time.perf_counter() - self.started)
        if self.tty:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()
        else:
            self._line(f"{self.label}: {'done' if self.done >= self.total else 'stopped'} in {elapsed}")

    def _count(self) -> str:
        return f"{self.fmt(self.done)}/{self.fmt(self.total)}{self.unit}"

    def _what(self) -> str:
        return f" {self.item}" if self.item else ""

    def _clock(self) -> str:
        left = self.time_left()
        tail = "estimating time left" if left is None else f"~{duration(left)} left"
        if self.done >= self.total:
            tail = "done"
        return f"{duration(time.perf_counter() - self.started)} elapsed, {tail}"

    def _draw(self, force: bool = False) -> None:
        with self.lock:
            now = time.perf_counter()
            if not force and now - self.last_draw < 0.2:
                return
            filled = int(WIDTH * self.done / self.total) if self.total else WIDTH
            bar = "#" * filled + "-" * (WIDTH - filled)
            text = f"{self.label} [{bar}] {self._count()}{self._what()}  {self._clock()}"
            self.stream.write("\r\x1b[2K" + text)
            self.stream.flush()
            self.last_draw = now

    def _tick(self) -> None:
        while not self.stop.wait(1.0):
            self._draw(force=True)

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()
