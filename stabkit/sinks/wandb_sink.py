"""Weights & Biases sink (`MonitorConfig(wandb=...)`, ``pip install 'stabkit[wandb]'``).

Built at `attach` on the writing rank; written at each log interval, on every event and on text
notes; closed at `detach`. What lands in the run:

- metrics under the names TensorBoard uses (``act/blocks.0/rms``, ``grad/global_norm``, ``loss``),
  one history row per logged step, each with ``stabkit/step`` = the monitor's step, declared as the
  x-axis of stabkit's charts (`define_metric`), so an event decided after later rows were written
  still lands on its own step;
- each event as the scalar ``events/<kind>`` at its step; ONE ``stabkit/events`` table (step,
  severity, kind, where, value, threshold, message, advice, incident, details: every event so far)
  and ONE ``stabkit/incidents`` table (id, severity, first and last step, kinds, members, the series
  that moved first, headline: each incident as it last stood), both rewritten at the flush after a
  change; the count of events of each severity as ``events/info``, ``events/warning``,
  ``events/critical`` (history and summary);
- text notes (audit report, model map, interventions) as rows of the ``stabkit/notes`` table; the
  audit once more as the ``stabkit/audit`` table (one row per finding) and its counts in the summary;
- the monitor's settings as the run's config, under ``stabkit``.

Never stalls training. Every W&B call runs on a background thread (`stabkit.sinks.background`):
`attach` and each step hand it rows and never wait for it; `detach` waits at most
`stabkit.sinks.background.BUDGET` seconds (the thread finishes the run after it). A run stabkit
starts is started there, within `WandbOptions.init_timeout` (W&B's own ``init_timeout``); the rows
logged meanwhile wait for it. In online mode, a server that does not accept a connection at
`attach` (within `stabkit.sinks.trackers.CONNECT_BUDGET` seconds) is named unreachable
(``connection refused``) with one warning and the sink is off at once.

`WandbOptions.join`: with a run already started in this process (``wandb.run``) stabkit logs into it
(names prefixed ``stabkit/`` unless `WandbOptions.prefix` says otherwise) and never finishes it;
otherwise it starts its own run (``reinit="create_new"``: ``wandb.run`` and your own ``wandb.init``
are left alone) and finishes it after `detach`. In a joined run W&B's own step (``_step``) stays
yours: stabkit's values are added to your current step (``commit=False``), one of stabkit's rows per
step of yours (the thread waits for your next ``log`` to add the next row), so your charts keep
their x-axis without gaps and stabkit's are drawn against ``stabkit/step``. When you log less often
than stabkit has rows, the rows that find no step of yours are skipped (counted in the summary as
``stabkit/rows_skipped``; every row is in the JSONL log and TensorBoard); ``join=False`` gives
stabkit a run of its own with every row. In offline mode the run is a folder to upload with
``wandb sync``.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from typing import Any

from ..config import MonitorConfig, WandbOptions
from ..events import Event
from .background import STALL, Background
from .trackers import (
    AUDIT_COLUMNS,
    EVENT_COLUMNS,
    INCIDENT_COLUMNS,
    STEP_KEY,
    TrackerError,
    audit_rows,
    chart_group,
    endpoint_problem,
    event_row,
    incident_row,
    metric_prefix,
    require,
    run_name,
    run_params,
    severity_counts,
    translated,
    warn_late,
)

EVENTS_TABLE = "stabkit/events"
INCIDENTS_TABLE = "stabkit/incidents"
NOTES_TABLE = "stabkit/notes"
AUDIT_TABLE = "stabkit/audit"
MAX_BACKLOG = 1000
"""Rows a joined run keeps waiting for the user's next steps; older ones are skipped."""
NOTE_COLUMNS = ("step", "tag", "text")

Row = tuple[int, dict[str, Any]]


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
        current = self.wandb.run if options.join else None
        self.owned = current is None
        """True when stabkit starts the run (and so finishes it at close)."""
        self.run: Any = current
        """The run written to (None until the writer has started stabkit's own)."""
        self.prefix = metric_prefix(options.prefix, joined=not self.owned)
        self.label = "the W&B run" if current is None else f"the W&B run {current.name!r} ({current.id})"
        self.skipped = 0
        """Rows of a joined run that found no step of the user's (see the module doc)."""
        self._groups: set[str] = set()
        self._rows: list[Row] = []
        """Rows kept since the last flush (training thread)."""
        self._backlog: deque[Row] = deque()
        """A joined run's rows waiting for the user's next step (writer thread)."""
        self._extra: dict[str, Any] = {}
        """Tables and counts waiting to ride on a joined run's next row (writer thread)."""
        self._paced_at: int | None = None
        """The user's step stabkit last added a row to."""
        self._events: list[Event] = []
        self._incidents: dict[int, list[Any]] = {}
        self._notes: list[list[Any]] = []
        self._audit: tuple[list[list[str]], dict[str, Any]] | None = None
        self._changed: set[str] = set()
        """Tables changed since the last flush."""
        params = run_params(config)
        diagnose = None
        if self.owned:
            url, mode = self._server(options)
            if mode in ("online", "shared"):
                problem = endpoint_problem(url)
                if problem is not None:
                    raise TrackerError(f"the W&B server {url} is unreachable ({problem})")
                diagnose = lambda: unreachable(url)  # noqa: E731
        self.writer = Background(
            "W&B",
            stall=options.init_timeout + STALL if self.owned else None,
            diagnose=diagnose,
            idle=None if self.owned else self._pace,
            late=lambda exc: warn_late(self.label, exc),
        )
        if self.owned:
            self._submit(lambda: self._start(options, params, logdir), "start the run")
        else:
            self._submit(lambda: self._join(params), "join the run")

    def _server(self, options: WandbOptions) -> tuple[str | None, str | None]:
        """The W&B server and mode a run stabkit starts would use (options, else ``WANDB_*``, else
        W&B's settings files); no network."""
        url: str | None = options.base_url
        mode: str | None = options.mode
        try:
            from wandb.sdk import wandb_setup

            settings = wandb_setup.singleton().settings
            url, mode = url or settings.base_url, mode or settings.mode
        except Exception:  # another W&B version: what the options say
            pass
        return url, mode

    def _start(self, options: WandbOptions, params: dict[str, Any], logdir: str | Path | None) -> None:
        """On the writer thread, first: start stabkit's own run (at most `options.init_timeout`)."""
        tags = list(dict.fromkeys([*options.tags, "stabkit"]))
        folder = options.dir or (str(logdir) if logdir is not None else None)
        if folder is not None:
            Path(folder).mkdir(parents=True, exist_ok=True)
        settings: dict[str, Any] = {"init_timeout": options.init_timeout}
        if options.base_url is not None:
            settings["base_url"] = options.base_url
        run = self.wandb.init(
            project=options.project,
            entity=options.entity,
            name=run_name(options.name, logdir),
            group=options.group,
            tags=tags,
            mode=options.mode,
            dir=folder,
            config={"stabkit": params},
            reinit="create_new",
            settings=self.wandb.Settings(**settings),
        )
        try:
            run.define_metric(STEP_KEY, hidden=True)
        except BaseException:  # started but unusable: do not leave it running
            run.finish(exit_code=1)
            raise
        self.run = run
        self.label = f"the W&B run {run.name!r} ({run.id})"

    def _join(self, params: dict[str, Any]) -> None:
        """On the writer thread, first: the settings into the user's run's config, the step metric."""
        self.run.config.update({"stabkit": params}, allow_val_change=True)
        self.run.define_metric(STEP_KEY, hidden=True)

    def _submit(self, job: Any, what: str) -> None:
        """Queue `job` for the writer; W&B's errors become TrackerError saying what failed."""

        def guarded() -> None:
            with translated(self._errors, f"W&B could not {what}"):
                job()

        self.writer.submit(guarded, what)

    # ------------------------------------------------------------------ training thread
    def write_metrics(self, step: int, values: dict[str, float]) -> None:
        """Keep one logged step's metrics (handed to the writer at the next flush)."""
        self._rows.append((int(step), {name: float(value) for name, value in values.items()}))

    def write_event(self, event: Event) -> None:
        """Keep the event: scalar ``events/<kind>`` at its step, a row of the events table."""
        self._rows.append((int(event.step), {f"events/{event.kind}": float(event.value)}))
        self._events.append(event)
        self._changed.add(EVENTS_TABLE)

    def write_text(self, tag: str, text: str, step: int = 0) -> None:
        """Keep a text note (audit report, model map) as a new row of the notes table."""
        self._notes.append([int(step), tag, text])
        self._changed.add(NOTES_TABLE)

    def write_record(self, kind: str, data: dict[str, Any]) -> None:
        """An ``incident`` record updates its row of the incidents table (the last of an id wins);
        the audit becomes a table (one row per finding) and its counts go to the summary; other
        records are for the JSONL log."""
        if kind == "incident":
            self._incidents[int(data.get("id", -1))] = incident_row(data)
            self._changed.add(INCIDENTS_TABLE)
        elif kind == "audit":
            self._audit = (audit_rows(data), dict(data.get("summary", {})))
            self._changed.add(AUDIT_TABLE)

    def flush(self) -> None:
        """Hand the writer what was kept since the last flush (when it has room; else it stays kept
        for the next one). Never waits; raises what the writer failed at since."""
        self.writer.check()
        if self.writer.room():
            self._hand_over()

    def _hand_over(self) -> None:
        if not self._rows and not self._changed:
            return
        rows, self._rows = self._rows, []
        names = [name for _, values in rows for name in values]
        groups = {self.prefix + chart_group(n) for n in names} - self._groups
        self._groups |= groups
        tables, summary = self._tables()
        self._submit(lambda: self._write(groups, rows, tables, summary), f"log {len(rows)} row(s)")

    def _tables(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The tables changed since the last flush (each rewritten whole), the event counts by
        severity and the summary values."""
        changed, self._changed = self._changed, set()
        Table = self.wandb.Table
        out: dict[str, Any] = {}
        summary: dict[str, Any] = {}
        if EVENTS_TABLE in changed:
            out[EVENTS_TABLE] = Table(columns=list(EVENT_COLUMNS), data=[event_row(e) for e in self._events])
            for severity, n in severity_counts(self._events).items():
                out[f"{self.prefix}events/{severity}"] = n
                summary[f"stabkit/events/{severity}"] = n
        if INCIDENTS_TABLE in changed:
            rows = [self._incidents[i] for i in sorted(self._incidents)]
            out[INCIDENTS_TABLE] = Table(columns=list(INCIDENT_COLUMNS), data=rows)
            summary["stabkit/incidents"] = len(rows)
        if NOTES_TABLE in changed:
            out[NOTES_TABLE] = Table(columns=list(NOTE_COLUMNS), data=[list(r) for r in self._notes])
        if AUDIT_TABLE in changed and self._audit is not None:
            findings, counts = self._audit
            out[AUDIT_TABLE] = Table(columns=list(AUDIT_COLUMNS), data=findings)
            summary.update({f"{AUDIT_TABLE}/{k}": v for k, v in counts.items()})
        return out, summary

    # ------------------------------------------------------------------ writer thread
    def _write(
        self, groups: set[str], rows: list[Row], tables: dict[str, Any], summary: dict[str, Any]
    ) -> None:
        """Declare new chart groups, then log the rows: in stabkit's own run one history row each
        (the tables and counts with the newest); in a joined run into the backlog (`_pace`)."""
        for group in sorted(groups):
            self.run.define_metric(group, step_metric=STEP_KEY)
        prefixed = [(step, {self.prefix + k: v for k, v in values.items()}) for step, values in rows]
        if self.owned:
            for i, (step, values) in enumerate(prefixed):
                extra = tables if i == len(prefixed) - 1 else {}
                self.run.log({STEP_KEY: step, **values, **extra})
            if tables and not prefixed:
                self.run.log(tables)
        else:
            self._backlog.extend(prefixed)
            self._extra.update(tables)
            while len(self._backlog) > MAX_BACKLOG:
                self._backlog.popleft()
                self.skipped += 1
            self._pace()
        if summary:
            self.run.summary.update(summary)

    def _user_step(self) -> int:
        """The joined run's current step (the one the user's next ``log`` commits)."""
        step = getattr(self.run, "_local_step", None)
        return int(step) if isinstance(step, int) else int(self.run.step)

    def _pace(self) -> None:
        """A joined run: when the user's step moved on since stabkit's last row, add the next row
        (with the tables and counts waiting) to it, without committing it."""
        if self.run is None or (not self._backlog and not self._extra):
            return
        if self._user_step() == self._paced_at:
            return
        step, values = self._backlog.popleft() if self._backlog else (None, {})
        data = {**values, **self._extra}
        if step is not None:
            data[STEP_KEY] = step
        self._extra = {}
        with translated(self._errors, "W&B could not log a row"):
            self.run.log(data, commit=False)
        self._paced_at = self._user_step()  # the user may have committed meanwhile: not that step

    def _finish(self) -> None:
        """Last job: a joined run gets its newest waiting row (the others are counted skipped); a run
        stabkit started is finished."""
        if self.owned:
            self.run.finish()
            return
        newest = self._backlog.pop() if self._backlog else None
        self.skipped += len(self._backlog)
        self._backlog.clear()
        if newest is not None and self._user_step() == self._paced_at:
            self.skipped += 1  # the user's current step already holds a row of stabkit's
            newest = None
        data = {**(newest[1] if newest else {}), **self._extra}
        if newest is not None:
            data[STEP_KEY] = newest[0]
        self._extra = {}
        if data:
            self.run.log(data, commit=False)
        if self.skipped:
            self.run.summary.update({"stabkit/rows_skipped": self.skipped})

    def close(self) -> None:
        """Hand over what is kept and finish the run if stabkit started it (a joined run is left
        running); waits at most `stabkit.sinks.background.BUDGET` seconds. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._hand_over()
            self._submit(self._finish, "finish the run" if self.owned else "log the last rows")
        finally:
            self.writer.stop()


def unreachable(url: str | None) -> str | None:
    """``<url> is unreachable (connection refused)`` when the server does not answer now, else None."""
    problem = endpoint_problem(url, budget=1.0)
    return f"{url} is unreachable ({problem})" if problem else None
