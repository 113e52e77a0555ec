"""MLflow sink (`MonitorConfig(mlflow=...)`, ``pip install 'stabkit[mlflow]'``).

Built at `attach` on the writing rank; written at each log interval, on every event and on text
notes; closed at `detach`. What lands in the run:

- metrics under the names TensorBoard uses (``act/blocks.0/rms``; MLflow keys take ``/``), each at
  the monitor's step (characters MLflow refuses become ``_``; ±inf is stored as ±1.8e308);
- each event as the metric ``events/<kind>`` at its step; the events so far in ONE artifact
  ``stabkit/events.json`` (``{"events": [...]}``: every event with its severity, incident id and
  advice) and ``stabkit/events.md`` (one line each), rewritten at the flush after an event; the
  incidents (``write_record("incident", ...)``; the last record of an id wins) likewise in
  ``stabkit/incidents.json`` (``{"incidents": [...]}``) and ``stabkit/incidents.md`` (one headline
  each); the count of events of each severity as the metrics ``events/info``, ``events/warning``,
  ``events/critical``;
- text notes as ``stabkit/<tag>.md`` artifacts (``stabkit/audit.md``, ``stabkit/model_map.md``); the
  audit report once more as ``stabkit/audit.json``;
- the monitor's settings as parameters ``stabkit.<field>`` (``stabkit.detect.options.spike.window``).

Never stalls training: at `attach` an http(s) server that does not accept a connection within
`stabkit.sinks.trackers.CONNECT_BUDGET` seconds is called unreachable (``connection refused``) and
the sink is off at once (one warning). Every MLflow call runs on a background thread
(`stabkit.sinks.background`): the training thread only hands it what was kept since the last flush,
and `detach` waits at most `stabkit.sinks.background.BUDGET` seconds (the thread writes the rest,
and ends the run, after it). A call hanging longer than `stabkit.sinks.background.STALL` seconds
switches the sink off, naming the cause. `MlflowOptions.join`: with an active run
(``mlflow.active_run()``, else ``MLFLOW_RUN_ID``) stabkit logs into it — metric names prefixed
``stabkit/`` unless `MlflowOptions.prefix` says otherwise; parameters it already has are kept — and
never ends it; otherwise it starts its own run and ends it (FINISHED) after `detach`.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

from ..config import MlflowOptions, MonitorConfig
from ..events import Event
from .background import Background
from .jsonl import json_safe
from .trackers import (
    TrackerError,
    endpoint_problem,
    flat_params,
    metric_prefix,
    note_path,
    notes_text,
    require,
    run_name,
    run_params,
    safe_key,
    severity_counts,
    translated,
    warn_late,
)

BATCH = 1000
"""Metrics per `log_batch` call (MLflow's limit)."""
PARAM_BATCH = 100
"""Parameters per `log_batch` call (MLflow's limit)."""
EVENTS_JSON, EVENTS_MD = "stabkit/events.json", "stabkit/events.md"
INCIDENTS_JSON, INCIDENTS_MD = "stabkit/incidents.json", "stabkit/incidents.md"


class MlflowSink:
    """Writes one monitor's metrics, events and notes to an MLflow run (its own, or the active one)."""

    def __init__(
        self,
        options: MlflowOptions | None = None,
        config: MonitorConfig | None = None,
        logdir: str | Path | None = None,
    ) -> None:
        options = options or MlflowOptions()
        mlflow = require("mlflow", "mlflow")
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException

        self._metric, self._param = Metric, Param
        self._errors: tuple[type[BaseException], ...] = (MlflowException,)
        self._closed = False
        with translated(self._errors, "MLflow could not read the active run"):
            active = mlflow.active_run() if options.join else None  # per thread: read it here
            run_id: str | None = active.info.run_id if active is not None else None
            self.tracking_uri: str | None = (
                mlflow.get_tracking_uri() if active is not None else options.tracking_uri
            )
            uri = self.tracking_uri or mlflow.get_tracking_uri()  # the environment's; no network
        problem = endpoint_problem(uri)
        if problem is not None:
            raise TrackerError(f"the MLflow tracking server {uri} is unreachable ({problem})")
        if run_id is None and options.join:
            run_id = os.environ.get("MLFLOW_RUN_ID") or None
        self.owned = run_id is None
        """True when stabkit starts the run (and so ends it at close)."""
        self.run_id = run_id
        """The run written to (None until the writer has started stabkit's own)."""
        self.client: Any = None
        self.label = f"the MLflow run in {self.tracking_uri or 'the default tracking store'}"
        self.prefix = metric_prefix(options.prefix, joined=not self.owned)
        self._keys: dict[str, str] = {}
        self._pending: list[Any] = []
        self._events: list[Event] = []
        self._incidents: dict[int, dict[str, Any]] = {}
        self._dirty = False
        """Events or incidents came since the files were last queued."""
        self._notes: dict[str, list[tuple[int, str]]] = {}
        self._records: dict[str, list[dict[str, Any]]] = {}
        self.writer = Background(
            "MLflow", diagnose=lambda: unreachable(uri), late=lambda exc: warn_late(self.label, exc)
        )
        params = {safe_key(k): v for k, v in flat_params(run_params(config)).items()}
        self._run("open the run", lambda: self._open(options, params, logdir))

    def _open(self, options: MlflowOptions, params: dict[str, str], logdir: str | Path | None) -> None:
        """On the writer thread, first: connect (a new SQLite store is created here: seconds), start
        the run unless joining one, log the parameters."""
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(self.tracking_uri)
        self.tracking_uri = self.client.tracking_uri
        if self.run_id is None:
            tags = {**({"stabkit.logdir": str(logdir)} if logdir is not None else {}), **options.tags}
            run = self.client.create_run(
                self._experiment_id(options.experiment), run_name=run_name(options.name, logdir), tags=tags
            )
            self.run_id = run.info.run_id
        else:
            self.client.get_run(self.run_id)  # a joined run must exist
        self.label = f"the MLflow run {self.run_id} ({self.tracking_uri})"
        self._log_params(params)

    def _experiment_id(self, name: str | None) -> str:
        """The experiment a new run goes to: `name` (created if missing; two processes may race),
        else ``MLFLOW_EXPERIMENT_ID`` / ``MLFLOW_EXPERIMENT_NAME``, else MLflow's "Default" (id 0)."""
        if name is None:
            exp_id = os.environ.get("MLFLOW_EXPERIMENT_ID")
            if exp_id:
                return exp_id
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "Default"
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        if name == "Default":
            return "0"
        try:
            return str(self.client.create_experiment(name))
        except self._errors:  # created meanwhile by another process
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return str(found.experiment_id)

    def _log_params(self, params: dict[str, str]) -> None:
        """Log the settings as parameters; ones the run already has are kept (MLflow parameters
        cannot change), and said once when they differ."""
        have = self.client.get_run(self.run_id).data.params
        differ = sorted(k for k in params if k in have and have[k] != params[k])
        new = [self._param(k, v) for k, v in params.items() if k not in have]
        for i in range(0, len(new), PARAM_BATCH):
            self.client.log_batch(self.run_id, params=new[i : i + PARAM_BATCH])
        if differ:
            warnings.warn(
                f"stabkit: the MLflow run {self.run_id} already has other values for {', '.join(differ)} "
                "(a parameter cannot change): kept them; this monitor's settings are in its JSONL log",
                RuntimeWarning,
                stacklevel=4,
            )

    def _key(self, name: str) -> str:
        key = self._keys.get(name)
        if key is None:
            key = self._keys[name] = safe_key(self.prefix + name)
        return key

    def _run(self, what: str, job: Any) -> None:
        """Queue `job` for the background writer; its MLflow errors become TrackerError saying what
        could not be done (``MLflow could not store the events: ...``)."""

        def guarded() -> None:
            with translated(self._errors, f"MLflow could not {what}"):
                job()

        self.writer.submit(guarded, what)

    def write_metrics(self, step: int, values: dict[str, float]) -> None:
        """Keep one logged step's metrics (queued at the next flush, in batches)."""
        now = int(time.time() * 1000)
        metric = self._metric
        self._pending.extend(metric(self._key(k), float(v), now, int(step)) for k, v in values.items())

    def _submit(self, force: bool = False) -> None:
        """Queue what was kept since the last time — metrics, and the events and incidents files when
        they changed — as one job; while the writer is busy with earlier ones it stays kept (nothing
        waits) unless `force` (at close)."""
        if not (self._pending or self._dirty) or not (force or self.writer.room()):
            return
        pending, self._pending = self._pending, []
        files: dict[str, Any] = {}
        if self._dirty:
            self._dirty = False
            files = self._tables()
            now, step = int(time.time() * 1000), max(e.step for e in self._events)
            pending += [
                self._metric(self._key(f"events/{severity}"), float(n), now, step)
                for severity, n in severity_counts(self._events).items()
            ]

        def log() -> None:
            for i in range(0, len(pending), BATCH):
                self.client.log_batch(self.run_id, metrics=pending[i : i + BATCH])
            for path, content in files.items():
                if path.endswith(".json"):
                    self.client.log_dict(self.run_id, content, path)
                else:
                    self.client.log_text(self.run_id, content, path)

        what = f"store {len(pending)} metric value(s)" + (" and the events" if files else "")
        self._run(what, log)

    def _tables(self) -> dict[str, Any]:
        """The events and incidents files as they stand: path -> content (dict for JSON, else text)."""
        incidents = [self._incidents[i] for i in sorted(self._incidents)]
        files: dict[str, Any] = {
            EVENTS_JSON: {"events": [json_safe(e.to_dict()) for e in self._events]},
            EVENTS_MD: "".join(f"[{getattr(e, 'severity', 'warning')}] {e}\n" for e in self._events),
        }
        if incidents:
            files[INCIDENTS_JSON] = {"incidents": incidents}
            files[INCIDENTS_MD] = "".join(
                f"[{r.get('severity', '')}] {r.get('headline', '')}\n" for r in incidents
            )
        return files

    def write_event(self, event: Event) -> None:
        """Keep the event: metric ``events/<kind>`` at its step, a row of the events files (queued at
        the next flush)."""
        now = int(time.time() * 1000)
        self._pending.append(
            self._metric(self._key(f"events/{event.kind}"), float(event.value), now, event.step)
        )
        self._events.append(event)
        self._dirty = True

    def write_text(self, tag: str, text: str, step: int = 0) -> None:
        """The note as artifact ``stabkit/<tag>.md`` (a tag written again gets a section per step)."""
        entries = self._notes.setdefault(tag, [])
        entries.append((int(step), text))
        content, path = notes_text(entries), note_path(tag)
        self._run(f"store the note {tag!r}", lambda: self.client.log_text(self.run_id, content, path))

    def write_record(self, kind: str, data: dict[str, Any]) -> None:
        """An ``incident`` record updates its row of the incidents files (queued at the next flush;
        the last record of an id wins); another record (the audit report) is stored as artifact
        ``stabkit/<kind>.json`` (``{"records": [...]}`` when the kind comes more than once)."""
        if kind == "incident":
            self._incidents[int(data.get("id", -1))] = json_safe(data)
            self._dirty = True
            return
        if kind == "run":  # the JSONL log's; MLflow has the run's own start time and tags
            return
        records = self._records.setdefault(kind, [])
        records.append(json_safe(data))
        content = records[0] if len(records) == 1 else {"records": list(records)}
        path = note_path(kind, ".json")
        self._run(f"store the {kind} record", lambda: self.client.log_dict(self.run_id, content, path))

    def flush(self) -> None:
        """Queue what was kept since the last flush (when the writer has room); raise what the
        writer failed at since. Never waits."""
        self.writer.check()
        self._submit()

    def close(self) -> None:
        """Queue everything kept, then the end of the run if stabkit started it (FINISHED); wait at
        most `stabkit.sinks.background.BUDGET` seconds: the writer finishes the rest after `detach`. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._submit(force=True)
            if self.owned:
                self._run("end the run", lambda: self.client.set_terminated(self.run_id))
        finally:
            self.writer.stop()


def unreachable(uri: str | None) -> str | None:
    """``<uri> is unreachable (connection refused)`` when its server does not answer now, else None."""
    problem = endpoint_problem(uri, budget=1.0)
    return f"{uri} is unreachable ({problem})" if problem else None
