"""Weights & Biases sink (`MonitorConfig(wandb=...)`, ``pip install 'stabkit[wandb]'``).

Built at `attach` on the writing rank; written at each log interval, on every event and on text
notes; closed at `detach`. What lands in the run:

- metrics under the names TensorBoard uses (``act/blocks.0/rms``, ``grad/global_norm``, ``loss``),
  one history row per logged step, each with ``stabkit/step`` = the monitor's step, declared as the
  x-axis of stabkit's charts (`define_metric`). W&B's own step counter is never set (each row
  advances it by one), so an event decided after later rows were written still lands on its own
  step, and a joined run's own logging without ``step=`` goes on as before (with ``step=`` W&B would
  drop the user's rows once stabkit's got ahead: `WandbOptions.join` = False then);
- each event as the scalar ``events/<kind>`` and a row of the ``stabkit/events`` table (step, kind,
  where, value, threshold, message, advice, details; logged incrementally);
- text notes (audit report, model map, interventions) as rows of the ``stabkit/notes`` table; the
  audit once more as the ``stabkit/audit`` table (one row per finding) and its counts in the summary;
- the monitor's settings as the run's config, under ``stabkit``.

`WandbOptions.join`: with a run already started in this process (``wandb.run``) stabkit logs into it
(names prefixed ``stabkit/`` unless `WandbOptions.prefix` says otherwise) and never finishes it;
otherwise it starts its own run (``reinit="create_new"``: ``wandb.run`` and your own ``wandb.init``
are left alone) and finishes it at `detach`. W&B sends from its own service process, so nothing
here waits for the network; in offline mode the run is a folder to upload with ``wandb sync``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import MonitorConfig, WandbOptions
from ..events import Event
from .trackers import (
    AUDIT_COLUMNS,
    EVENT_COLUMNS,
    STEP_KEY,
    audit_rows,
    chart_group,
    event_row,
    metric_prefix,
    require,
    run_name,
    run_params,
    translated,
)

EVENTS_TABLE = "stabkit/events"
NOTES_TABLE = "stabkit/notes"
AUDIT_TABLE = "stabkit/audit"


class WandbSink:
    """Writes one monitor's metrics, events and notes to a W&B run (its own, or the one already running)."""

    def __init__(
        self,
        options: WandbOptions | None = None,
        config: MonitorConfig | None = None,
        logdir: str | Path | None = None,
    ) -> None:
        options = options or WandbOptions()
        self.wandb = require("wandb", "wandb")
        self._errors: tuple[type[BaseException], ...] = (self.wandb.Error,)
        self._closed = False
        params = run_params(config)
        with translated(self._errors, "W&B could not start the run"):
            current = self.wandb.run if options.join else None
            self.owned = current is None
            """True when stabkit started the run (and so finishes it at close)."""
            if current is None:
                tags = list(dict.fromkeys([*options.tags, "stabkit"]))
                folder = options.dir or (str(logdir) if logdir is not None else None)
                if folder is not None:
                    Path(folder).mkdir(parents=True, exist_ok=True)
                self.run: Any = self.wandb.init(
                    project=options.project,
                    entity=options.entity,
                    name=run_name(options.name, logdir),
                    group=options.group,
                    tags=tags,
                    mode=options.mode,
                    dir=folder,
                    config={"stabkit": params},
                    reinit="create_new",
                )
            else:
                self.run = current
            try:
                if not self.owned:
                    self.run.config.update({"stabkit": params}, allow_val_change=True)
                self.run.define_metric(STEP_KEY, hidden=True)
            except BaseException:
                if self.owned:  # started but unusable: do not leave it running
                    self.run.finish(exit_code=1)
                raise
        self.prefix = metric_prefix(options.prefix, joined=not self.owned)
        self.label = f"the W&B run {self.run.name!r} ({self.run.id})"
        self._groups: set[str] = set()
        self._events = self.wandb.Table(columns=list(EVENT_COLUMNS), log_mode="INCREMENTAL")
        self._notes = self.wandb.Table(columns=["step", "tag", "text"], log_mode="INCREMENTAL")

    def _log(self, step: int, data: dict[str, Any], what: str) -> None:
        """One history row: `data` at the monitor's `step` (W&B's own step advances by one)."""
        with translated(self._errors, f"W&B refused {what}"):
            self.run.log({STEP_KEY: int(step), **data})

    def _declare(self, names: list[str]) -> None:
        """Charts of new metric names (before the prefix) use the monitor's step as x-axis: one
        declaration per family (``act/*``, under the prefix)."""
        for group in {self.prefix + chart_group(n) for n in names} - self._groups:
            with translated(self._errors, "W&B refused a metric definition"):
                self.run.define_metric(group, step_metric=STEP_KEY)
            self._groups.add(group)

    def write_metrics(self, step: int, values: dict[str, float]) -> None:
        """One logged step: every metric under its TensorBoard name (after the prefix)."""
        self._declare(list(values))
        row = {self.prefix + name: float(value) for name, value in values.items()}
        self._log(step, row, f"the metrics of step {step}")

    def write_event(self, event: Event) -> None:
        """The event as scalar ``events/<kind>`` and as a new row of the events table."""
        self._declare([f"events/{event.kind}"])
        scalar = f"{self.prefix}events/{event.kind}"
        self._events.add_data(*event_row(event))
        self._log(event.step, {scalar: float(event.value), EVENTS_TABLE: self._events}, "an event")

    def write_text(self, tag: str, text: str, step: int = 0) -> None:
        """A text note (audit report, model map) as a new row of the notes table."""
        self._notes.add_data(int(step), tag, text)
        self._log(step, {NOTES_TABLE: self._notes}, f"the note {tag!r}")

    def write_record(self, kind: str, data: dict[str, Any]) -> None:
        """The audit as a table (one row per finding) and its counts in the run's summary; other
        records are for the JSONL log."""
        if kind != "audit":
            return
        table = self.wandb.Table(columns=list(AUDIT_COLUMNS), data=audit_rows(data))
        summary = data.get("summary", {})
        with translated(self._errors, "W&B refused the audit"):
            self.run.log({AUDIT_TABLE: table})
            self.run.summary.update({f"{AUDIT_TABLE}/{k}": v for k, v in summary.items()})

    def flush(self) -> None:
        """Nothing to do: each row is handed to W&B's service process as it is logged."""

    def close(self) -> None:
        """Finish the run if stabkit started it (a joined run is left running). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.owned:
            with translated(self._errors, "W&B could not finish the run"):
                self.run.finish()
