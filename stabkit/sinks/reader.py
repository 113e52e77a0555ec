"""Read a finished (or running) run back from its JSONL log: `load_run(logdir)` -> `Run`.

Runs when a user, a notebook or `stabkit report` opens a logdir after (or while) training; it reads
``<folder>/stabkit.jsonl`` once (`read_jsonl`: a torn last line is skipped) and keeps every row type
the sinks write (docs: "Reading a run back"):

- ``metrics`` rows -> `Run.series(name)`: the steps and values of each metric as numpy arrays;
- ``event`` rows -> `Run.events`: `stabkit.events.Event` objects, severity included;
- ``incident`` rows -> `Run.incidents` (the last row of each id wins: an incident grows as it goes on);
- ``audit`` -> `Run.audit`, ``config`` -> `Run.config`, ``run`` -> `Run.starts`, ``text`` -> `Run.texts`;
  rows of any other kind -> `Run.records[kind]`.

A logdir that holds several runs (``run-2``, ``run-3``, … beside the first one: `MonitorConfig.logdir_mode`
"new") is read one run at a time: the newest by default, another with ``run=``; `load_runs` reads them all.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from ..events import Event
from .jsonl import LOG_NAME, read_jsonl
from .rundir import run_folders, run_number

_EVENT_FIELDS = frozenset(f.name for f in dataclasses.fields(Event))
_NONFINITE = MappingProxyType({"nan": math.nan, "inf": math.inf, "-inf": -math.inf})


def _number(value: Any) -> Any:
    """The JSONL writes non-finite floats as "nan", "inf", "-inf": back to floats, recursively."""
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    if isinstance(value, dict):
        return {k: _number(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_number(v) for v in value]
    return value


def event_from_row(row: dict[str, Any]) -> Event:
    """An ``{"type": "event", ...}`` row as the `Event` the monitor reported (lists where it had
    tuples: JSON keeps no tuples). Keys `Event` does not know (a newer writer's) go into its details."""
    data = _number({k: v for k, v in row.items() if k != "type"})
    known = {k: v for k, v in data.items() if k in _EVENT_FIELDS}
    details = dict(known.get("details") or {})
    details.update({k: v for k, v in data.items() if k not in _EVENT_FIELDS and k not in details})
    known["details"] = details
    return Event(**known)


@dataclass(frozen=True)
class Series:
    """One metric of a run: the logged steps (int64) and their values (float64; nan/inf kept)."""

    name: str
    steps: np.ndarray
    values: np.ndarray

    def __len__(self) -> int:
        return len(self.steps)

    def __repr__(self) -> str:
        span = f", steps {self.steps[0]}-{self.steps[-1]}" if len(self.steps) else ""
        return f"Series({self.name!r}, {len(self.steps)} values{span})"


@dataclass
class Run:
    """One monitored run read back from its ``stabkit.jsonl`` (`load_run`)."""

    path: Path
    """The run's folder (the logdir, or its ``run-<n>`` subfolder)."""
    name: str
    """The folder's name (``run-2`` for a later run of a logdir)."""
    events: list[Event] = field(default_factory=list)
    """What the detectors found, in the order they were reported."""
    incidents: list[dict[str, Any]] = field(default_factory=list)
    """Grouped events, one dict per incident id (its last row), by first step: keys ``id``,
    ``first_step``, ``last_step``, ``severity``, ``kinds``, ``members``, ``first``, ``headline``.
    Empty for logs written before incidents existed."""
    audit: dict[str, Any] | None = None
    """The architecture audit made at attach (`stabkit.audit.AuditReport.to_dict`); None when off."""
    config: dict[str, Any] | None = None
    """The `MonitorConfig` the run was attached with, as plain JSON types (None in older logs)."""
    starts: list[dict[str, Any]] = field(default_factory=list)
    """One ``run`` row per attach that wrote to this log (several after ``logdir_mode="append"``)."""
    texts: list[dict[str, Any]] = field(default_factory=list)
    """Text notes (``tag``, ``step``, ``text``): the model map, the interventions, the audit as markdown."""
    records: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Rows of any other kind, by kind (what a newer stabkit or a plug-in wrote)."""
    _series: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)

    @property
    def log(self) -> Path:
        """The JSONL file read."""
        return self.path / LOG_NAME

    @property
    def metrics(self) -> list[str]:
        """The names of every metric logged, sorted."""
        return sorted(self._series)

    @property
    def steps(self) -> np.ndarray:
        """Every step at which some metric was logged, ascending."""
        if not self._series:
            return np.zeros(0, dtype=np.int64)
        return np.unique(np.concatenate([s for s, _ in self._series.values()]))

    def series(self, name: str) -> Series:
        """Steps and values of metric `name` (e.g. ``"loss"``, ``"grad/global_norm"``). KeyError, with
        the closest names, for a metric this run did not log."""
        if name not in self._series:
            close = difflib.get_close_matches(name, self._series, n=3, cutoff=0.5)
            hint = (
                f"; did you mean {', '.join(close)}?"
                if close
                else f"; {len(self._series)} metrics in run.metrics"
            )
            raise KeyError(f"{self.name} logged no metric {name!r}{hint}")
        steps, values = self._series[name]
        return Series(name, steps, values)

    def to_pandas(self) -> Any:
        """The metrics as a pandas DataFrame: one row per logged step (the index), one column per
        metric (NaN where a metric was not logged at that step). Needs pandas (`pip install pandas`)."""
        try:
            import pandas as pd
        except ImportError as exc:
            raise ImportError(
                "Run.to_pandas needs pandas: pip install pandas (Run.series needs nothing)"
            ) from exc
        columns = {
            name: pd.Series(values, index=steps) for name, (steps, values) in sorted(self._series.items())
        }
        frame = pd.DataFrame(columns)
        frame.index.name = "step"
        return frame

    def __repr__(self) -> str:
        return (
            f"Run({self.name!r}, {len(self._series)} metrics over {len(self.steps)} steps, "
            f"{len(self.events)} events, {len(self.incidents)} incidents, path={str(self.path)!r})"
        )


def run_from_rows(rows: list[dict[str, Any]], folder: Path) -> Run:
    """A `Run` from the rows of its log (`read_jsonl`)."""
    run = Run(path=folder, name=folder.name)
    columns: dict[str, tuple[list[int], list[float]]] = {}
    incidents: dict[Any, dict[str, Any]] = {}
    for row in rows:
        kind = row.get("type")
        data = {k: v for k, v in row.items() if k != "type"}
        if kind == "metrics":
            step = int(row["step"])
            for name, value in row["values"].items():
                steps, values = columns.setdefault(name, ([], []))
                steps.append(step)
                values.append(value)
        elif kind == "event":
            run.events.append(event_from_row(row))
        elif kind == "incident":
            incidents[data.get("id")] = _number(data)  # the last row of an id wins
        elif kind == "audit":
            run.audit = _number(data)
        elif kind == "config":
            run.config = _number(data)
        elif kind == "run":
            run.starts.append(data)
        elif kind == "text":
            run.texts.append(data)
        else:
            run.records.setdefault(str(kind), []).append(_number(data))
    run._series = {
        name: (np.asarray(steps, dtype=np.int64), np.asarray(values, dtype=np.float64))
        for name, (steps, values) in columns.items()
    }
    run.incidents = sorted(incidents.values(), key=lambda i: (i.get("first_step", 0), str(i.get("id"))))
    return run


def run_paths(logdir: str | Path) -> list[Path]:
    """The folders under `logdir` whose ``stabkit.jsonl`` `load_run` can read, oldest first: `logdir`
    itself when it holds a run, then ``run-2``, ``run-3``, …"""
    return [f for f in run_folders(logdir) if (f / LOG_NAME).is_file()]


def _pick(root: Path, folders: list[Path], run: int | str | None) -> Path:
    if run is None:
        return folders[-1]
    for folder in folders:
        number = 1 if folder == root else run_number(folder)
        if run in (number, folder.name) or str(run) == str(number):
            return folder
    names = ", ".join(f"{1 if f == root else run_number(f)} ({f.name})" for f in folders)
    raise ValueError(f"{root} holds no run {run!r}; its runs: {names}")


def load_run(logdir: str | Path, run: int | str | None = None) -> Run:
    """Read one monitored run back: its series, events, incidents, audit and config (see `Run`).

    `logdir` is the folder given to `stabkit.attach` (or its ``stabkit.jsonl`` itself). When it holds
    several runs — ``attach`` puts a later run into ``run-2``, ``run-3``, … — the newest is read;
    ``run=1`` picks the logdir's own (first) run, ``run=n`` (or ``"run-n"``) the n-th; `Run.name` says
    which was read, `run_paths(logdir)` lists them. Raises FileNotFoundError when there is no log,
    naming the subfolders that hold one (a `stabkit run` recipe's output keeps one run per variant:
    ``load_run("runs/alg/baseline")``)."""
    root = Path(logdir)
    if root.is_file():
        return run_from_rows(read_jsonl(root), root.parent)
    folders = run_paths(root)
    if not folders:
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: no such folder; pass the logdir given to stabkit.attach")
        inner = sorted(p.parent.name for p in root.glob(f"*/{LOG_NAME}"))
        hint = (
            f"; the runs below it: {', '.join(inner)} (load_run({str(root / inner[0])!r}))" if inner else ""
        )
        raise FileNotFoundError(f"{root} holds no {LOG_NAME}{hint}")
    folder = _pick(root, folders, run)
    return run_from_rows(read_jsonl(folder / LOG_NAME), folder)


def load_runs(logdir: str | Path) -> list[Run]:
    """Every run of `logdir` (`run_paths`), oldest first; [] when it holds none."""
    return [run_from_rows(read_jsonl(f / LOG_NAME), f) for f in run_paths(logdir)]
