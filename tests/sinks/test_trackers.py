"""The W&B and MLflow sinks, for real: a monitored training run (a NaN loss at one step makes a
`nonfinite` event) read back with each tracker's own reader — W&B in offline mode through
``wandb leet inspect --json``, W&B's reader of an offline run's ``.wandb`` log (its public API needs a
server), MLflow on a SQLite store through `MlflowClient`. Also: the settings switches, joining a run
the user started (and never finishing it), only rank 0 writing under DDP, and trackers that are not
installed, unreachable, or fail mid-run never stopping training.

The tracker packages come with ``pip install -e '.[wandb,mlflow]'`` (.ci/run installs them); without
them the round trips skip. W&B tests are `multiprocess`: ``wandb.init`` starts W&B's service process.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from zoo import batch, lm_loss, reference_gpt

import stabkit
from stabkit.config import MlflowOptions, MonitorConfig, WandbOptions
from stabkit.distributed import DistContext, rank_sinks
from stabkit.events import Event
from stabkit.sinks import LOG_NAME, SinkSet, read_jsonl
from stabkit.sinks.background import Background
from stabkit.sinks.jsonl import json_safe
from stabkit.sinks.trackers import (
    TrackerError,
    audit_rows,
    endpoint_problem,
    event_row,
    flat_params,
    incident_row,
    note_path,
    run_params,
    safe_key,
    severity_counts,
)
from stabkit.tables import fill

pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")
"""SQLAlchemy 2.1 about MLflow's own store code."""

NAN_STEP = 7
STEPS = 12


def train(logdir: Path | None, steps: int = STEPS, **config: Any) -> stabkit.Monitor:
    """A tiny GPT trained `steps` steps, its loss replaced by NaN at `NAN_STEP` (a `nonfinite` event)."""
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = MonitorConfig(every=2, log_every=5, console=False, **config)
    with stabkit.attach(model, opt, logdir=logdir, config=cfg) as mon:
        for s in range(steps):
            x, y = batch(s)
            loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            mon.step(float("nan") if s == NAN_STEP else loss)
            opt.zero_grad()
    return mon


def same(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-12)


def tracker_failures(mon: stabkit.Monitor) -> dict[str, str]:
    return {k: v for k, v in mon.sinks.failures.items() if "W&B" in k or "MLflow" in k}


def settle(mon: stabkit.Monitor) -> None:
    """Wait until the trackers' writers have stored what `detach` left them (it waits 2 s at most)."""
    for sink in mon.sinks.files:
        writer = getattr(sink, "writer", None)
        if isinstance(writer, Background):
            assert writer.join(120), f"{sink} still writing after 120 s"


def unreachable_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "stabkit: cannot write" in str(w.message)]


# ------------------------------------------------------------------ settings and helpers (no package)
def test_switches_take_true_a_dict_or_options_and_name_a_bad_key() -> None:
    assert MonitorConfig().wandb is None and MonitorConfig(mlflow=False).mlflow is None
    assert MonitorConfig(wandb=True).wandb == WandbOptions()
    cfg = MonitorConfig(wandb={"project": "p", "tags": ["a"]}, mlflow={"experiment": "e", "join": False})
    assert cfg.wandb == WandbOptions(project="p", tags=("a",))
    assert cfg.mlflow == MlflowOptions(experiment="e", join=False)
    with pytest.raises(ValueError, match=r"MonitorConfig\.wandb\.projekt: unknown key; allowed: project"):
        MonitorConfig(wandb={"projekt": "p"})
    with pytest.raises(ValueError, match="WandbOptions.mode must be one of"):
        WandbOptions(mode="off")  # type: ignore[arg-type]
    assert MonitorConfig(wandb={"init_timeout": 5}).wandb == WandbOptions(init_timeout=5.0)
    assert WandbOptions().init_timeout == 30.0  # not W&B's 90 s
    for bad in (0, -1, 601):
        with pytest.raises(ValueError, match=r"WandbOptions.init_timeout must be in \(0, 600\] seconds"):
            WandbOptions(init_timeout=bad)
    with pytest.raises(ValueError, match="MonitorConfig.mlflow must be True/False, a dict"):
        MonitorConfig(mlflow="sqlite:///x.db")
    recipe = fill(MonitorConfig, {"wandb": True, "mlflow": {"tracking_uri": "sqlite:///m.db"}}, "monitor")
    assert recipe.wandb == WandbOptions() and recipe.mlflow == MlflowOptions(tracking_uri="sqlite:///m.db")


def test_params_names_and_rows() -> None:
    cfg = MonitorConfig(every=3, wandb=True, detect=stabkit.DetectConfig(options={"spike": {"window": 64}}))
    nested = run_params(cfg)
    assert "wandb" not in nested and "mlflow" not in nested
    assert nested["every"] == 3 and nested["families"] == sorted(cfg.families)
    flat = flat_params(nested)
    assert flat["stabkit.every"] == "3" and flat["stabkit.detect.options.spike.window"] == "64"
    assert flat["stabkit.detect.actions.spike"] == '["warn"]' and flat["stabkit.modules"] == "None"
    assert safe_key("act//rms") == "act/_/rms" and safe_key("act/h[0]:x/rms") == "act/h_0__x/rms"
    assert safe_key("act/blocks.0.attn/max_logit") == "act/blocks.0.attn/max_logit"
    assert note_path("stabkit/audit") == "stabkit/audit.md" and note_path("mine") == "stabkit/mine.md"
    ev = Event(3, "spike", "loss", math.inf, 2.0, "loss spiked", "lower the LR", {"incident": 2}, "critical")
    assert event_row(ev) == [
        3,
        "critical",
        "spike",
        "loss",
        math.inf,
        2.0,
        "loss spiked",
        "lower the LR",
        2,
        '{"incident": 2}',
    ]
    assert event_row(Event(1, "drift", "x", 1.0, 2.0, "m"))[1::7] == ["warning", -1]  # no incident
    record = {
        "id": 4,
        "first_step": 7,
        "last_step": 9,
        "severity": "critical",
        "kinds": ["nonfinite", "spike"],
    }
    record |= {"members": 3, "first": "loss", "headline": "incident 4 at steps 7–9: ..."}
    assert incident_row(record) == [4, "critical", 7, 9, "nonfinite, spike", 3, "loss", record["headline"]]
    evs = [Event(0, "a", "x", 0, 0, "m", severity=s) for s in ("info", "critical", "critical")]
    assert severity_counts(evs) == {"info": 1, "warning": 0, "critical": 2}
    finding = {
        "severity": "risk",
        "rule": "r",
        "where": ["a", "b"],
        "evidence": {"x": 1},
        "why": "w",
        "fix": ["f"],
    }
    assert audit_rows({"findings": [finding]}) == [["risk", "r", "a, b", '{"x": 1}', "w", "f"]]


def test_background_writer_keeps_order_and_raises_a_jobs_error_in_the_caller() -> None:
    done: list[int] = []
    writer = Background("test", limit=2, budget=5.0)
    for i in range(5):
        writer.submit(lambda i=i: done.append(i))
    assert writer.wait()
    assert done == [0, 1, 2, 3, 4]

    def boom() -> None:
        raise TrackerError("store down")

    writer.submit(boom)
    writer.submit(lambda: done.append(99))  # dropped: the writer failed before it
    with pytest.raises(TrackerError, match="store down"):
        writer.wait()
    with pytest.raises(TrackerError, match="store down"):
        writer.stop()
    assert done == [0, 1, 2, 3, 4]


def test_a_hung_store_costs_the_caller_a_bounded_wait_and_is_named_once_stalled() -> None:
    """A job that never returns: submit, wait and stop each give up after `budget`; once the job has
    run past `stall` the writer says so with the cause `diagnose` finds."""
    release = threading.Event()
    writer = Background("store", limit=1, budget=0.3, stall=1.0, diagnose=lambda: "connection refused")
    writer.submit(lambda: release.wait(30), "store 5 metric value(s)")
    writer.submit(lambda: None)  # queued behind the hung job: the queue is now full
    t0 = time.monotonic()
    with pytest.raises(TrackerError, match="not keeping up"):
        writer.submit(lambda: None)
    assert writer.wait() is False
    assert time.monotonic() - t0 < 0.3 * 2 + 0.5  # two budgets, not the hung job's 30 s
    writer.check()  # still within `stall`: not (yet) an error
    time.sleep(1.1)
    with pytest.raises(
        TrackerError,
        match=r"store has not answered for \d+ s \(store 5 metric value\(s\)\): connection refused",
    ):
        writer.check()
    t0 = time.monotonic()
    with pytest.raises(TrackerError, match="has not answered"):
        writer.stop()
    assert time.monotonic() - t0 < 0.2  # a hung writer is not waited for again
    release.set()


def test_stop_hands_what_is_left_to_the_thread_after_its_budget() -> None:
    done: list[int] = []
    writer = Background("slow", budget=0.2)
    for i in range(3):
        writer.submit(lambda i=i: (time.sleep(0.15), done.append(i)))
    t0 = time.monotonic()
    assert writer.stop() is False  # returned after the budget, the queue not yet written
    assert time.monotonic() - t0 < 0.5 and done != [0, 1, 2]
    assert writer.join(10) and done == [0, 1, 2]  # ... and written after it


def test_endpoint_problem_names_a_refused_connection_and_accepts_a_listening_port() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        assert endpoint_problem(f"http://127.0.0.1:{port}") is None
    assert endpoint_problem(f"http://127.0.0.1:{port}") == "connection refused"  # closed now
    assert endpoint_problem("http://127.0.0.1:9/api") == "connection refused"
    assert endpoint_problem("sqlite:///x.db") is None and endpoint_problem(None) is None
    assert endpoint_problem("databricks") is None


def test_missing_packages_name_the_extra_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.warns(RuntimeWarning) as caught:
        mon = train(tmp_path / "run", wandb=True, mlflow=True, strict=True)
    said = [str(w.message) for w in caught if "stabkit: cannot write" in str(w.message)]
    assert len(said) == 2
    assert "pip install 'stabkit[wandb]'" in said[0] and "pip install 'stabkit[mlflow]'" in said[1]
    assert set(tracker_failures(mon)) == {"the W&B run", "the MLflow run"}
    assert [s for s, _ in mon.history] == list(range(STEPS))
    logged = [r["step"] for r in read_jsonl(mon.logdir / LOG_NAME) if r["type"] == "metrics"]
    assert logged == list(range(STEPS))


def test_only_the_writing_rank_builds_trackers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    config = MonitorConfig(console=False, wandb=True, mlflow=True)
    other = rank_sinks(tmp_path / "r1", config, DistContext(True, 1, 2))
    assert other.files == [] and other.failures == {}  # never tried: no warning, no run
    with pytest.warns(RuntimeWarning) as caught:
        writer = rank_sinks(tmp_path / "r0", config, DistContext(True, 0, 2))
    assert sum("pip install 'stabkit[" in str(w.message) for w in caught) == 2
    assert set(writer.failures) == {"the W&B run", "the MLflow run"}  # tried (and not installed here)
    other.close()
    writer.close()


# ------------------------------------------------------------------ MLflow, SQLite store
@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """An empty MLflow SQLite store, made once per test session (creating one runs MLflow's
    migrations: ~9 s; the xdist workers share it through a file lock); each test copies it."""
    pytest.importorskip("mlflow", reason="pip install -e '.[mlflow]'")
    pytest.importorskip("sqlalchemy", reason="pip install -e '.[mlflow]'")
    pytest.importorskip("alembic", reason="pip install -e '.[mlflow]'")
    from filelock import FileLock
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.getbasetemp()
    root = root.parent if worker_id != "master" else root  # the session's folder, shared by workers
    path = root / "mlflow-template.db"
    with FileLock(f"{path}.lock"):
        if not path.exists():
            made = path.with_suffix(".part.db")
            here = Path.cwd()
            os.chdir(root)  # the Default experiment's artifacts: <root>/mlruns/0 (not the checkout)
            try:
                MlflowClient(f"sqlite:///{made}").search_experiments()
            finally:
                os.chdir(here)
            made.rename(path)
    return path


@pytest.fixture
def mlflow_uri(tmp_path: Path, mlflow_template: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)  # experiments made by the test keep their artifacts in ./mlruns
    db = tmp_path / "mlflow.db"
    shutil.copy(mlflow_template, db)
    return f"sqlite:///{db}"


def mlflow_files(client: Any, run_id: str, path: str | None = None) -> Iterator[str]:
    for info in client.list_artifacts(run_id, path):
        if info.is_dir:
            yield from mlflow_files(client, run_id, info.path)
        else:
            yield info.path


def mlflow_read(client: Any, run_id: str, path: str, dest: Path) -> str:
    return Path(client.download_artifacts(run_id, path, str(dest))).read_text(encoding="utf-8")


def test_mlflow_round_trip(tmp_path: Path, mlflow_uri: str) -> None:
    from mlflow.tracking import MlflowClient

    opts = {"tracking_uri": mlflow_uri, "experiment": "stabkit-test", "tags": {"team": "lm"}}
    mon = train(tmp_path / "exp1", mlflow=opts)
    settle(mon)
    assert tracker_failures(mon) == {}
    client = MlflowClient(mlflow_uri)
    exp = client.get_experiment_by_name("stabkit-test")
    [run] = client.search_runs([exp.experiment_id])
    rid = run.info.run_id
    assert run.info.status == "FINISHED" and run.info.run_name == "exp1"  # the logdir's name
    assert run.data.tags["team"] == "lm" and run.data.tags["stabkit.logdir"] == str(tmp_path / "exp1")
    assert run.data.params == flat_params(run_params(mon.config))

    # every logged value at its step, under the TensorBoard names
    want: dict[str, list[tuple[int, float]]] = {}
    for step, values in mon.history:
        for name, value in values.items():
            want.setdefault(name, []).append((step, value))
    counts = {f"events/{s}" for s in ("info", "warning", "critical")}
    assert set(run.data.metrics) == {*want, "events/nonfinite", *counts}
    for name, series in want.items():
        got = [(m.step, m.value) for m in client.get_metric_history(rid, name)]
        assert [s for s, _ in got] == [s for s, _ in series], name
        assert all(same(g, w) for (_, g), (_, w) in zip(got, series)), name
    [event] = client.get_metric_history(rid, "events/nonfinite")
    assert event.step == NAN_STEP and math.isnan(event.value)
    [ev] = mon.events
    for severity in ("info", "warning", "critical"):  # counts of events by severity
        [count] = client.get_metric_history(rid, f"events/{severity}")
        assert (count.step, count.value) == (NAN_STEP, float(severity == ev.severity))
    acc = EventAccumulator(str(mon.logdir), size_guidance={"scalars": 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) | counts == set(run.data.metrics)  # TensorBoard's names

    files = set(mlflow_files(client, rid))
    names = ("audit.md", "audit.json", "model_map.md", "events.json", "events.md")
    assert files == {f"stabkit/{n}" for n in (*names, "incidents.json", "incidents.md")}
    events = json.loads(mlflow_read(client, rid, "stabkit/events.json", tmp_path / "dl"))["events"]
    assert events == [json_safe(e.to_dict()) for e in mon.events]
    assert events[0]["kind"] == "nonfinite" and events[0]["advice"] and events[0]["severity"] == ev.severity
    assert mlflow_read(client, rid, "stabkit/events.md", tmp_path / "dl") == f"[{ev.severity}] {ev}\n"
    [incident] = mon.incidents.incidents
    incidents = json.loads(mlflow_read(client, rid, "stabkit/incidents.json", tmp_path / "dl"))
    assert incidents == {"incidents": [json_safe(incident.to_dict())]}
    assert ev.details["incident"] == incident.id
    lines = mlflow_read(client, rid, "stabkit/incidents.md", tmp_path / "dl")
    assert lines == f"[{incident.severity}] {incident.headline()}\n"
    assert mlflow_read(client, rid, "stabkit/audit.md", tmp_path / "dl") == mon.audit_report.to_markdown()
    audit = json.loads(mlflow_read(client, rid, "stabkit/audit.json", tmp_path / "dl"))
    assert audit == json_safe(mon.audit_report.to_dict())
    assert "blocks" in mlflow_read(client, rid, "stabkit/model_map.md", tmp_path / "dl")


def test_mlflow_joins_the_active_run_and_leaves_it_running(
    tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    client = MlflowClient(mlflow_uri)
    with mlflow.start_run(run_name="mine") as mine:
        mlflow.log_param("stabkit.every", "999")  # already there, with another value
        mlflow.log_metric("loss", 1.0, step=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mon = train(tmp_path / "run", mlflow=True)
            settle(mon)
        assert client.get_run(mine.info.run_id).info.status == "RUNNING"  # stabkit did not end it
        mlflow.log_metric("loss", 0.5, step=1)  # the user's own logging goes on
    assert tracker_failures(mon) == {}
    assert any("already has other values for stabkit.every" in str(w.message) for w in caught)
    run = client.get_run(mine.info.run_id)
    assert run.info.status == "FINISHED" and len(client.search_runs(["0"])) == 1
    assert run.data.params["stabkit.every"] == "999" and run.data.params["stabkit.log_every"] == "5"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss")] == [
        (0, 1.0),
        (1, 0.5),
    ]
    ours = client.get_metric_history(run.info.run_id, "stabkit/loss")  # prefixed in a joined run
    assert [m.step for m in ours] == list(range(STEPS))


def test_unreachable_mlflow_server_costs_seconds_and_one_warning_naming_it(tmp_path: Path) -> None:
    """Nothing listens on 127.0.0.1:9: attach, 20 steps and detach stay within seconds (MLflow's own
    retries would take minutes), and one warning says "connection refused", at attach."""
    pytest.importorskip("mlflow", reason="pip install -e '.[mlflow]'")
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = train(tmp_path / "run", steps=20, mlflow={"tracking_uri": "http://127.0.0.1:9"}, strict=True)
    assert time.monotonic() - t0 < 15
    [said] = unreachable_warnings(caught)
    assert "the MLflow tracking server http://127.0.0.1:9 is unreachable (connection refused)" in said
    [(name, why)] = tracker_failures(mon).items()
    assert name == "the MLflow run" and "connection refused" in why
    assert [s for s, _ in mon.history] == list(range(20)) and [e.kind for e in mon.events] == ["nonfinite"]
    logged = [r["step"] for r in read_jsonl(mon.logdir / LOG_NAME) if r["type"] == "metrics"]
    assert logged == list(range(20))


def test_a_tracking_store_that_hangs_mid_run_never_holds_a_step_or_detach(
    tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every metric write hangs (a server that stopped answering): the steps and detach wait at most
    the budget each; once the write runs past `stall`, one warning says so."""
    from mlflow.tracking import MlflowClient

    import stabkit.sinks.background as background

    release = threading.Event()
    real = MlflowClient.log_batch

    def log_batch(self: Any, run_id: str, metrics: Any = (), **kw: Any) -> Any:
        if metrics:
            release.wait(60)
        return real(self, run_id, metrics=metrics, **kw)

    monkeypatch.setattr(MlflowClient, "log_batch", log_batch)
    monkeypatch.setattr(background, "STALL", 1.0)
    monkeypatch.setattr(background, "BUDGET", 0.5)
    slow: list[float] = []
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        model = reference_gpt()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        cfg = MonitorConfig(every=2, log_every=5, console=False, mlflow={"tracking_uri": mlflow_uri})
        with stabkit.attach(model, opt, logdir=tmp_path / "run", config=cfg) as mon:
            for s in range(20):
                x, y = batch(s)
                loss = lm_loss(model(x), y)
                loss.backward()
                opt.step()
                t = time.monotonic()
                mon.step(loss)
                slow.append(time.monotonic() - t)
                opt.zero_grad()
                time.sleep(0.1)
    release.set()
    assert time.monotonic() - t0 < 30 and max(slow) < 1.5  # no step held past the budget
    [said] = unreachable_warnings(caught)
    assert "MLflow has not answered for" in said and "store" in said
    assert [s for s, _ in mon.history] == list(range(20))


def test_mlflow_writes_that_fail_mid_run_switch_the_sink_off_once(
    tmp_path: Path, mlflow_uri: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    real = MlflowClient.log_batch

    def log_batch(self: Any, run_id: str, metrics: Any = (), **kw: Any) -> Any:
        if metrics:
            raise MlflowException("tracking server went away")
        return real(self, run_id, metrics=metrics, **kw)

    monkeypatch.setattr(MlflowClient, "log_batch", log_batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = train(tmp_path / "run", mlflow={"tracking_uri": mlflow_uri}, strict=True)
        settle(mon)
    said = [str(w.message) for w in caught if "cannot write the MLflow run" in str(w.message)]
    assert len(said) == 1 and "tracking server went away" in said[0]
    assert "MLflow could not store" in next(iter(tracker_failures(mon).values()))
    assert [s for s, _ in mon.history] == list(range(STEPS))
    logged = [r["step"] for r in read_jsonl(mon.logdir / LOG_NAME) if r["type"] == "metrics"]
    assert logged == list(range(STEPS))


# ------------------------------------------------------------------ W&B, offline
@pytest.fixture
def wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """W&B in offline mode with every folder it writes under tmp_path; yields WANDB_DIR. W&B reads
    its environment once per process (and keeps a run's settings): torn down before and after."""
    wandb = pytest.importorskip("wandb", reason="pip install -e '.[wandb]'")
    home = tmp_path / "wandb-home"
    for name, sub in (
        ("WANDB_DIR", "dir"),
        ("WANDB_DATA_DIR", "data"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_ARTIFACT_DIR", "artifacts"),
    ):
        (home / sub).mkdir(parents=True)
        monkeypatch.setenv(name, str(home / sub))
    for name, value in (
        ("WANDB_MODE", "offline"),
        ("WANDB_SILENT", "true"),
        ("WANDB_CONSOLE", "off"),
        ("WANDB_DISABLE_GIT", "true"),
        ("WANDB_DISABLE_CODE", "true"),
    ):
        monkeypatch.setenv(name, value)
    for name in ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_ID", "WANDB_NAME"):
        monkeypatch.delenv(name, raising=False)
    wandb.teardown()
    yield home / "dir"
    wandb.teardown()


def wandb_log(folder: Path) -> tuple[Path, list[dict[str, Any]]]:
    """The one offline run under `folder` and its records, read by W&B itself (`wandb leet inspect`)."""
    [run_file] = folder.glob("wandb/offline-run-*/run-*.wandb")
    proc = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "WANDB_MODE": "offline"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_file.parent, [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def history(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["history"]["item"] for r in records if r["type"] == "history"]


def table_rows(run_dir: Path, rows: list[dict[str, Any]], key: str) -> list[list[Any]]:
    """The rows of table `key` as last logged (each log rewrites the whole table)."""
    [*_, path] = [row[f"{key}.path"] for row in rows if f"{key}.path" in row]
    return list(json.loads((run_dir / "files" / path).read_text())["data"])


def table_logs(rows: list[dict[str, Any]], key: str) -> int:
    """How many times table `key` was logged (one file each)."""
    return sum(f"{key}.path" in row for row in rows)


def summary_of(records: list[dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for r in records:
        if r["type"] == "summary":
            summary.update(r["summary"].get("update", {}))
    return summary


def wandb_value(v: Any) -> float:
    return float(v) if not isinstance(v, str) else float(v.lower())  # "NaN", "Infinity"


@pytest.mark.multiprocess
def test_wandb_offline_round_trip(tmp_path: Path, wandb_offline: Path) -> None:
    opts = {"project": "stabkit-test", "tags": ["ci"]}
    mon = train(tmp_path / "exp1", wandb=opts)
    settle(mon)
    assert tracker_failures(mon) == {}
    run_dir, records = wandb_log(mon.logdir)  # in the logdir, beside the TensorBoard files
    [run] = [r["run"] for r in records if r["type"] == "run"]
    assert run["project"] == "stabkit-test" and run["display_name"] == "exp1"
    assert set(run["tags"]) == {"ci", "stabkit"}
    assert run["config"]["update"]["stabkit"] == run_params(mon.config)
    assert [r["exit"]["exit_code"] for r in records if r["type"] == "exit"] == [0]  # finished by stabkit

    rows = history(records)
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        if "stabkit/step" in row:
            by_step.setdefault(row["stabkit/step"], {}).update(row)
    for step, values in mon.history:  # every logged value at its step, under the TensorBoard names
        for name, value in values.items():
            assert same(wandb_value(by_step[step][name]), value), (step, name)
    assert math.isnan(wandb_value(by_step[NAN_STEP]["events/nonfinite"]))
    defined = {
        r["metric"].get("glob_name") or r["metric"].get("name"): r["metric"]
        for r in records
        if r["type"] == "metric"
    }
    assert (
        defined["act/*"]["step_metric"] == "stabkit/step" and defined["loss"]["step_metric"] == "stabkit/step"
    )
    assert defined["stabkit/step"]["options"]["hidden"] is True

    [ev] = mon.events
    [incident] = mon.incidents.incidents
    [event] = table_rows(run_dir, rows, "stabkit/events")
    assert event[:4] == [NAN_STEP, ev.severity, "nonfinite", "loss"] and event[7] == ev.advice
    assert event[8] == incident.id == ev.details["incident"]
    assert table_rows(run_dir, rows, "stabkit/incidents") == [incident_row(incident.to_dict())]
    assert table_logs(rows, "stabkit/events") == 1 and table_logs(rows, "stabkit/incidents") == 1
    [counts] = [r for r in rows if "events/critical" in r]
    assert counts["stabkit/step"] >= NAN_STEP
    assert {s: counts[f"events/{s}"] for s in ("info", "warning", "critical")} == severity_counts([ev])
    notes = {tag: text for _, tag, text in table_rows(run_dir, rows, "stabkit/notes")}
    assert notes["stabkit/audit"] == mon.audit_report.to_markdown() and "blocks" in notes["stabkit/model_map"]
    audit = table_rows(run_dir, rows, "stabkit/audit")
    assert audit == audit_rows(mon.audit_report.to_dict()) and audit
    summary = summary_of(records)
    assert summary["stabkit/audit/risks"] == len(mon.audit_report.risks)
    assert summary[f"stabkit/events/{ev.severity}"] == 1 and summary["stabkit/incidents"] == 1


@pytest.mark.multiprocess
def test_wandb_joins_the_users_run_keeps_its_steps_and_never_finishes_it(
    tmp_path: Path, wandb_offline: Path
) -> None:
    """The user logs `loss` once a step into their own run: their rows keep W&B steps 0, 1, 2, ...
    with no gap; stabkit's rows ride on them (one per user step, each value at its own stabkit/step)."""
    import wandb

    user = wandb.init(project="mine", dir=str(tmp_path / "mine"), config={"lr": 0.05})
    try:
        torch.manual_seed(0)
        model = reference_gpt()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        cfg = MonitorConfig(every=2, log_every=5, console=False, wandb=True)
        with stabkit.attach(model, opt, logdir=tmp_path / "run", config=cfg) as mon:
            for s in range(STEPS):
                x, y = batch(s)
                loss = lm_loss(model(x), y)
                loss.backward()
                opt.step()
                mon.step(float("nan") if s == NAN_STEP else loss)
                opt.zero_grad()
                user.log({"loss": loss.item()})
                time.sleep(0.2)  # the writer adds one stabkit row per user step (it looks every 50 ms)
        settle(mon)
        user.log({"loss": 0.5})  # still running: stabkit did not finish it
    finally:
        user.finish()
    assert tracker_failures(mon) == {}
    assert not (tmp_path / "run" / "wandb").exists()  # no run of its own
    _, records = wandb_log(tmp_path / "mine")
    config: dict[str, Any] = {}
    for r in records:
        if r["type"] in ("run", "config"):
            config.update((r.get("run", {}).get("config") or r.get("config", {})).get("update", {}))
    assert config["lr"] == 0.05 and config["stabkit"] == run_params(mon.config)
    rows = history(records)
    mine = [(r["_step"], r["loss"]) for r in rows if "loss" in r]
    assert [s for s, _ in mine] == list(range(STEPS + 1))  # the user's steps: no gap
    assert mine[-1][1] == 0.5
    ours = [r for r in rows if "stabkit/loss" in r]  # stabkit's, prefixed, each row at its own step
    steps = [r["stabkit/step"] for r in ours]
    assert steps == sorted(set(steps)) and len(steps) >= STEPS // 2
    logged = dict(mon.history)
    for r in ours:
        for name, value in logged[r["stabkit/step"]].items():
            assert same(wandb_value(r[f"stabkit/{name}"]), value), (r["stabkit/step"], name)
    placed = sum("stabkit/step" in r for r in rows)
    skipped = summary_of(records).get("stabkit/rows_skipped", 0)
    assert placed + skipped == len(mon.history) + len(mon.events)


@pytest.mark.multiprocess
def test_unreachable_wandb_server_costs_seconds_and_one_warning_naming_it(
    tmp_path: Path, wandb_offline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Online mode, nothing listening on 127.0.0.1:9 (W&B itself would retry for its 90 s init
    timeout): attach, 20 steps and detach take seconds, and one warning says "connection refused"."""
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)  # a key: only the server is missing
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = train(tmp_path / "run", steps=20, wandb={"base_url": "http://127.0.0.1:9"}, strict=True)
    assert time.monotonic() - t0 < 15
    [said] = unreachable_warnings(caught)
    assert "the W&B server http://127.0.0.1:9 is unreachable (connection refused)" in said
    assert list(tracker_failures(mon)) == ["the W&B run"]
    assert [s for s, _ in mon.history] == list(range(20)) and [e.kind for e in mon.events] == ["nonfinite"]
    assert not (tmp_path / "run" / "wandb").exists()  # no run was started


@pytest.mark.multiprocess
def test_a_wandb_server_that_never_answers_costs_seconds_and_one_warning_after_init_timeout(
    tmp_path: Path, wandb_offline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loopback port that accepts connections and never answers: the run starts on the writer
    thread, so attach, 20 steps and detach take seconds; after `init_timeout` (3 s) one warning
    names W&B's timeout."""
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)  # connections wait in the backlog: never accepted, never answered
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        slow: list[float] = []
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.manual_seed(0)
            model = reference_gpt()
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            opts = {"base_url": url, "init_timeout": 3}
            cfg = MonitorConfig(every=2, log_every=5, console=False, wandb=opts, strict=True)
            with stabkit.attach(model, opt, logdir=tmp_path / "run", config=cfg) as mon:
                for s in range(20):
                    x, y = batch(s)
                    loss = lm_loss(model(x), y)
                    loss.backward()
                    opt.step()
                    t = time.monotonic()
                    mon.step(loss)
                    slow.append(time.monotonic() - t)
                    opt.zero_grad()
            assert time.monotonic() - t0 < 15 and max(slow) < 1.0
            settle(mon)
    said = unreachable_warnings(caught)
    assert len(said) == 1 and "the W&B run" in said[0] and "init_timeout" in said[0], said
    assert [s for s, _ in mon.history] == list(range(20))


@pytest.mark.multiprocess
def test_wandb_log_that_fails_switches_the_sink_off_once(
    tmp_path: Path, wandb_offline: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import wandb
    from wandb.sdk.wandb_run import Run

    real = Run.log

    def log(self: Any, data: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        if any(k.startswith("grad/") for k in data):
            raise wandb.errors.CommError("network down")
        real(self, data, *args, **kwargs)

    monkeypatch.setattr(Run, "log", log)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = train(tmp_path / "run", wandb=True, strict=True)
        settle(mon)
    said = [str(w.message) for w in caught if "cannot write the W&B run" in str(w.message)]
    assert len(said) == 1 and "CommError: network down" in said[0]
    assert [s for s, _ in mon.history] == list(range(STEPS))
    logged = [r["step"] for r in read_jsonl(mon.logdir / LOG_NAME) if r["type"] == "metrics"]
    assert logged == list(range(STEPS))


# ------------------------------------------------------------------ one writer under DDP (2 ranks, gloo)
def ddp_rank(rank: int, world: int, init: str, logdir: str, out: str, uri: str) -> None:
    """One rank of a DDP job with both trackers on (run by torch.multiprocessing.spawn)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = DDP(reference_gpt())
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        cfg = MonitorConfig(
            log_every=2,
            console=False,
            wandb={"project": "ddp"},
            mlflow={"tracking_uri": uri, "experiment": "ddp"},
        )
        with stabkit.attach(model, opt, logdir=logdir, config=cfg) as mon:
            for s in range(4):
                x, y = batch(100 * rank + s)
                loss = lm_loss(model(x), y)
                loss.backward()
                opt.step()
                mon.step(loss)
                opt.zero_grad()
        result = {"sinks": [type(s).__name__ for s in mon.sinks.files], "failures": mon.sinks.failures}
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")
def test_one_tracker_run_per_ddp_job(tmp_path: Path, wandb_offline: Path, mlflow_uri: str) -> None:
    from mlflow.tracking import MlflowClient

    logdir, out = tmp_path / "run", tmp_path / "out"
    out.mkdir()
    torch.multiprocessing.spawn(
        ddp_rank, args=(2, str(tmp_path / "rdzv"), str(logdir), str(out), mlflow_uri), nprocs=2, join=True
    )
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == {"sinks": ["TensorBoardSink", "JsonlSink", "WandbSink", "MlflowSink"], "failures": {}}
    assert ranks[1] == {"sinks": [], "failures": {}}
    client = MlflowClient(mlflow_uri)
    [run] = client.search_runs([client.get_experiment_by_name("ddp").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0, 1, 2, 3]
    assert len(list(logdir.glob("wandb/offline-run-*"))) == 1


def test_sinkset_add_warns_once_for_a_tracker_that_cannot_start() -> None:
    sinks = SinkSet(None, tensorboard=False, jsonl=False, console=False)

    def broken() -> Any:
        raise TrackerError("bad URI")

    with pytest.warns(RuntimeWarning, match="cannot write the MLflow run \\(TrackerError: bad URI\\)"):
        sinks.add(broken, "the MLflow run")
    assert sinks.failures == {"the MLflow run": "TrackerError: bad URI"} and sinks.files == []
