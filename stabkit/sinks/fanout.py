"""`SinkSet`: the sinks of one monitor, fanned out, and kept from ever stopping training.

Built once at `attach` (on the writing rank: `stabkit.distributed.rank_sinks`); written at each log
interval, on every event and on text notes; closed at `detach`. A sink that fails — a full disk
(ENOSPC), a read-only or vanished logdir (EROFS, EACCES, ENOENT), a closed stderr, an experiment
tracker unreachable or not installed (`TrackerError`, an OSError) — is switched off: one
RuntimeWarning names it and the error, `SinkSet.failures` keeps the reason, the other sinks go on,
and the monitor keeps every logged step and event in memory (`Monitor.history`, `Monitor.events`).
Nothing a sink raises reaches the training loop (with `strict`, errors other than OSError still
raise: they are bugs, not a full disk).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Protocol

from ..config import MlflowOptions, MonitorConfig, WandbOptions
from ..events import Event
from .console import ConsoleSink
from .jsonl import JsonlSink
from .mlflow_sink import MlflowSink
from .rundir import choose_logdir
from .tensorboard import TensorBoardSink
from .wandb_sink import WandbSink


class Sink(Protocol):
    """What the Monitor calls on each sink."""

    def write_metrics(self, step: int, values: dict[str, float]) -> None: ...
    def write_event(self, event: Event) -> None: ...
    def write_text(self, tag: str, text: str, step: int = 0) -> None: ...
    def write_record(self, kind: str, data: dict[str, Any]) -> None:
        """Structured data (e.g. the audit report): sinks that keep records write it, others ignore it."""

    def flush(self) -> None: ...
    def close(self) -> None: ...


def reason(exc: BaseException) -> str:
    """`ENOSPC: No space left on device` for an OSError, else `TypeName: message`."""
    code = exc.errno if isinstance(exc, OSError) else None
    if code is not None and code in errno.errorcode:
        return f"{errno.errorcode[code]}: {getattr(exc, 'strerror', '')}"
    return f"{type(exc).__name__}: {exc}"


def label(sink: Any) -> str:
    """What a sink writes to, for messages."""
    return str(getattr(sink, "label", type(sink).__name__))


class SinkSet:
    """Fans out to every sink; the console only sees the newest step of each batch of rows.

    `logdir` is where the files go; `mode` (`MonitorConfig.logdir_mode`) decides what happens when
    it already holds a run (see `stabkit.sinks.rundir`). `self.logdir` is the folder actually
    written (None without file sinks).
    """

    def __init__(
        self,
        logdir: str | Path | None,
        tensorboard: bool,
        jsonl: bool,
        console: bool,
        mode: str = "new",
        strict: bool = False,
    ) -> None:
        self.files: list[Sink] = []
        self.console: ConsoleSink | None = ConsoleSink() if console else None
        self.strict = strict
        self.logdir: Path | None = None
        """The folder this run writes to (a ``run-<n>`` subfolder of the logdir asked for, when that
        one already held a run); None when no file sink is on."""
        self.failures: dict[str, str] = {}
        """Sinks switched off after an error: what they wrote to -> the error."""
        self._off: set[int] = set()
        self.closed = False
        if logdir is not None and (tensorboard or jsonl):
            self._open(Path(logdir), mode, tensorboard, jsonl)

    def _open(self, logdir: Path, mode: str, tensorboard: bool, jsonl: bool) -> None:
        """At attach: pick the run's folder, open the file sinks; what fails is warned about and off."""
        try:
            folder, note = choose_logdir(logdir, mode)
        except OSError as exc:
            self._disable(None, f"logdir {logdir}", exc)
            return
        self.logdir = folder
        if note:
            print(f"[stabkit] {note}", file=sys.stderr, flush=True)
        if tensorboard:
            self._add(lambda: TensorBoardSink(folder), f"TensorBoard events in {folder}")
        if jsonl:
            self._add(lambda: JsonlSink(folder), str(folder / "stabkit.jsonl"))
        self.write_record(
            "run",
            {
                "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "pid": os.getpid(),
                "logdir": str(folder),
                "requested": str(logdir),
                "mode": mode,
            },
        )

    def add(self, make: Any, name: str) -> None:
        """Add the sink `make()` returns (at attach); when making it fails, warn once naming `name`
        and go on without it (`failures` keeps the reason)."""
        self._add(make, name)

    def add_trackers(self, config: MonitorConfig, logdir: str | Path | None = None) -> None:
        """Add the experiment trackers `config` switches on (`MonitorConfig.wandb`, `.mlflow`), with
        the run's folder (`self.logdir`, else the `logdir` asked for) for their run name and W&B's
        files. One that cannot start (not installed, a bad URI) is warned about once and left off.
        Runs at attach, on the writing rank (`stabkit.distributed.rank_sinks`)."""
        folder = self.logdir if self.logdir is not None else logdir
        wandb, mlflow = config.wandb, config.mlflow
        if isinstance(wandb, WandbOptions):
            self.add(lambda: WandbSink(wandb, config, folder), "the W&B run")
        if isinstance(mlflow, MlflowOptions):
            self.add(lambda: MlflowSink(mlflow, config, folder), "the MLflow run")

    def _add(self, make: Any, name: str) -> None:
        try:
            self.files.append(make())
        except Exception as exc:
            if self.strict and not isinstance(exc, OSError):
                raise
            self._disable(None, name, exc)

    def _call(self, sink: Any, method: str, *args: Any) -> None:
        """`sink.method(*args)` unless the sink is off; an error switches it off (warned once)."""
        if id(sink) in self._off:
            return
        try:
            getattr(sink, method)(*args)
        except Exception as exc:
            if self.strict and not isinstance(exc, OSError):
                raise
            self._disable(sink, label(sink), exc)

    def _disable(self, sink: Any, name: str, exc: BaseException) -> None:
        """Switch a failed sink off and say so once (a RuntimeWarning; `failures`)."""
        if sink is not None:
            self._off.add(id(sink))
            with contextlib.suppress(Exception):  # it is broken already; nothing more to save
                sink.close()
        self.failures[name] = reason(exc)
        warnings.warn(
            f"stabkit: cannot write {name} ({reason(exc)}); stabkit stopped writing it and training goes "
            "on — Monitor.history and Monitor.events still hold every logged step and event",
            RuntimeWarning,
            stacklevel=2,
        )

    def write_rows(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        """Write drained rows (step, values) to the file sinks, the newest to the console; then flush."""
        if self.closed or not rows:
            return
        for sink in self.files:
            for step, values in rows:
                if id(sink) in self._off:
                    break
                self._call(sink, "write_metrics", step, values)
        if self.console is not None:
            self._call(self.console, "write_metrics", *rows[-1])
        for sink in self.files:
            self._call(sink, "flush")

    def write_event(self, event: Event) -> None:
        if self.closed:
            return
        for sink in self._all():
            self._call(sink, "write_event", event)

    def write_record(self, kind: str, data: dict[str, Any]) -> None:
        """Structured data (the JSONL log keeps it; the console prints the audit's risks, TensorBoard ignores it)."""
        if self.closed:
            return
        for sink in self._all():
            self._call(sink, "write_record", kind, data)

    def write_text(self, tag: str, text: str, step: int = 0) -> None:
        if self.closed:
            return
        for sink in self._all():
            self._call(sink, "write_text", tag, text, step)

    def flush(self) -> None:
        for sink in self._all():
            self._call(sink, "flush")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for sink in self._all():
            self._call(sink, "close")

    def _all(self) -> list[Sink]:
        return [*self.files, *([self.console] if self.console is not None else [])]
