"""`stabkit report LOGDIR --plot OUT`: which runs of LOGDIR to draw, then `stabkit.sinks.plot.plot_runs`.

Runs after `report` has read LOGDIR's summary. A monitored run's logdir draws its runs (the logdir's
own and its ``run-2``, …, one colour each); a `stabkit run` output draws every variant that left a
log; a sweep has no one run to draw (its LR curves are `stabkit sweep --plot`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..sinks import LOG_NAME
from ..sinks.reader import Run, load_run
from .app import UserInputError


def variant_logs(summary: Any, logdir: str | Path) -> list[Path]:
    """The ``stabkit.jsonl`` of each variant of `summary` that has one (its recorded logdir, else the
    folder of that name under LOGDIR: an output folder moved since)."""
    logs = []
    for name, result in summary.variants.items():
        for folder in (Path(result.get("logdir") or ""), Path(logdir) / name):
            if (folder / LOG_NAME).is_file():
                logs.append(folder / LOG_NAME)
                break
    return logs


def runs_to_draw(summary: Any, logdir: str | Path) -> list[Run]:
    """The runs `--plot` draws for `summary` (read from LOGDIR); UserInputError for a sweep or when no
    run left a log."""
    if summary.kind == "sweep":
        raise UserInputError(
            f"--plot draws runs and {logdir} is a sweep: pass one of its runs' folders, or see its LR curves"
        )
    runs = [load_run(log) for log in variant_logs(summary, logdir)]  # named by their folders
    if not runs:
        raise UserInputError(f"--plot: no {LOG_NAME} under {logdir} to draw")
    return runs


def need_matplotlib() -> None:
    """Before anything is read: UserInputError (exit 2, one line) when matplotlib is missing."""
    from ..sinks.plot import matplotlib_figure

    try:
        matplotlib_figure()
    except ImportError as exc:
        raise UserInputError(str(exc)) from None


def plot_report(summary: Any, logdir: str | Path, out: str | Path) -> Any:
    """Draw LOGDIR's runs to `out` (PNG, SVG or PDF by its suffix); returns the figure. UserInputError
    (exit 2, one line) when matplotlib is missing or `out` cannot be written."""
    from ..sinks.plot import plot_runs

    runs = runs_to_draw(summary, logdir)
    title = f"stabkit report {logdir}" + (f" ({summary.recipe})" if summary.kind == "run" else "")
    try:
        return plot_runs(runs, out, title=title)
    except ImportError as exc:
        raise UserInputError(str(exc)) from None
    except OSError as exc:
        raise UserInputError(f"--plot {out}: cannot write it ({exc.strerror or exc})") from None
