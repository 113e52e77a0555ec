"""`stabkit.load_run` reads a run back as the monitor saw it: every series equal to `mon.history`,
the events equal to `mon.events` (severity included), the audit and config; several runs in one
logdir, incident rows (the last row of an id wins), non-finite values and torn lines."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from zoo import batch, lm_loss, reference_gpt

import stabkit
from stabkit.sinks import LOG_NAME
from stabkit.sinks.reader import Run, load_runs, run_paths

SPIKE_STEP = 30


def train(logdir: Path, steps: int = 36, seed: int = 0, spike: int | None = SPIKE_STEP) -> stabkit.Monitor:
    """The tiny reference GPT; the loss is multiplied by 1000 at step `spike` (an injected spike)."""
    torch.manual_seed(seed)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    detect = stabkit.DetectConfig(options={"spike": {"min_history": 8, "window": 16}})
    cfg = stabkit.MonitorConfig(log_every=5, every=2, console=False, detect=detect)
    with stabkit.attach(model, opt, logdir=logdir, config=cfg) as mon:
        for s in range(steps):
            x, y = batch(seed * 1000 + s)
            loss = lm_loss(model(x), y)
            if s == spike:
                loss = loss * 1000
            loss.backward()
            opt.step()
            mon.step(loss)
            opt.zero_grad()
    return mon


def plain(value: Any) -> Any:
    """JSON types (tuples as lists), as the log keeps them."""
    return json.loads(json.dumps(value, default=str))


def test_a_run_reads_back_as_the_monitor_saw_it(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    mon = train(tmp_path)
    run = stabkit.load_run(tmp_path)
    assert run.path == tmp_path and run.name == tmp_path.name
    # every series: the steps and values the monitor kept in its history, in order
    expected: dict[str, tuple[list[int], list[float]]] = {}
    for step, values in mon.history:
        for name, value in values.items():
            expected.setdefault(name, ([], []))[0].append(step)
            expected[name][1].append(value)
    assert run.metrics == sorted(expected) and "loss" in run.metrics
    for name, (steps, values) in expected.items():
        series = run.series(name)
        assert series.steps.dtype == np.int64 and series.steps.tolist() == steps
        np.testing.assert_array_equal(series.values, np.asarray(values, dtype=np.float64))
    assert run.steps.tolist() == list(range(36))
    assert run.series("loss").values[SPIKE_STEP] > 100 * np.median(run.series("loss").values)
    # the events: the injected spike was found, and each event comes back equal to the monitor's
    assert mon.events and min(e.step for e in mon.events) == SPIKE_STEP  # nothing before the spike
    assert len(run.events) == len(mon.events)
    for got, want in zip(run.events, mon.events):
        assert isinstance(got, stabkit.Event)
        assert plain(got.to_dict()) == plain(want.to_dict())
        assert got.severity == want.severity
    assert str(run.events[0]) == str(mon.events[0])
    # incidents, where the monitor groups its events into them: each event's incident is read back
    ids = {e.details["incident"] for e in mon.events if "incident" in e.details}
    assert {i["id"] for i in run.incidents} == ids
    for incident in run.incidents:
        members = [e for e in mon.events if e.details.get("incident") == incident["id"]]
        assert incident["first_step"] == min(e.step for e in members)
    # the audit made at attach and the config attached with
    assert run.audit == plain(mon.audit_report.to_dict())
    assert run.config is not None
    assert run.config["log_every"] == 5 and run.config["every"] == 2
    assert run.config["detect"]["options"]["spike"]["window"] == 16
    assert len(run.starts) == 1 and run.starts[0]["logdir"] == str(tmp_path)
    assert any(t["tag"] == "stabkit/model_map" for t in run.texts)


def test_several_runs_in_one_logdir(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    first = train(tmp_path, steps=6, seed=1, spike=None)
    second = train(tmp_path, steps=4, seed=2, spike=None)
    assert second.logdir == tmp_path / "run-2"
    assert run_paths(tmp_path) == [tmp_path, tmp_path / "run-2"]
    newest = stabkit.load_run(tmp_path)
    assert newest.name == "run-2"
    assert newest.series("loss").values.tolist() == [v["loss"] for _, v in second.history]
    for choice in (1, "1", tmp_path.name):
        assert stabkit.load_run(tmp_path, run=choice).series("loss").values.tolist() == [
            v["loss"] for _, v in first.history
        ]
    assert stabkit.load_run(tmp_path, run="run-2").path == tmp_path / "run-2"
    assert [r.name for r in load_runs(tmp_path)] == [tmp_path.name, "run-2"]
    with pytest.raises(ValueError, match=r"holds no run 3; its runs: 1 .*, 2 \(run-2\)"):
        stabkit.load_run(tmp_path, run=3)


def write_log(folder: Path, rows: list[dict[str, Any]], tail: str = "") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows) + tail
    (folder / LOG_NAME).write_text(text, encoding="utf-8")


def test_incidents_last_row_wins_and_values_come_back(tmp_path: Path) -> None:
    incident = {"type": "incident", "severity": "warning", "kinds": ["spike"], "first": "loss"}
    rows = [
        {"type": "metrics", "step": 0, "values": {"loss": 2.5}},
        {"type": "metrics", "step": 2, "values": {"loss": "nan", "grad/global_norm": "inf"}},
        {"type": "event", "step": 2, "kind": "nonfinite", "where": "loss", "value": "nan", "threshold": 0.0,
         "message": "m", "advice": "", "details": {"seen": "-inf"}, "severity": "critical", "extra": 1},
        {**incident, "id": 2, "first_step": 5, "last_step": 5, "members": 1, "headline": "b"},
        {**incident, "id": 1, "first_step": 2, "last_step": 2, "members": 1, "headline": "a"},
        {**incident, "id": 1, "first_step": 2, "last_step": 4, "members": 3, "headline": "a grown"},
        {"type": "custom_plugin", "x": 1},
    ]  # fmt: skip
    write_log(tmp_path, rows, tail='{"type": "metrics", "step": 3, "val')  # torn last line
    run = stabkit.load_run(tmp_path)
    assert [(i["id"], i["members"], i["headline"]) for i in run.incidents] == [(1, 3, "a grown"), (2, 1, "b")]
    loss = run.series("loss")
    assert loss.steps.tolist() == [0, 2] and loss.values[0] == 2.5 and math.isnan(loss.values[1])
    assert run.series("grad/global_norm").values.tolist() == [math.inf]
    (event,) = run.events
    assert event.severity == "critical" and math.isnan(event.value)
    assert event.details == {"seen": -math.inf, "extra": 1}  # a key Event does not know goes to details
    assert run.records == {"custom_plugin": [{"x": 1}]}
    assert run.audit is None and run.config is None  # an older log: no audit, no config row
    with pytest.raises(KeyError, match="did you mean loss"):
        run.series("los")
    assert load_run_file(tmp_path).series("loss").steps.tolist() == [0, 2]


def load_run_file(folder: Path) -> Run:
    return stabkit.load_run(folder / LOG_NAME)  # the log file itself works too


def test_a_folder_without_a_log_names_the_runs_below_it(tmp_path: Path) -> None:
    write_log(tmp_path / "baseline", [{"type": "metrics", "step": 0, "values": {"loss": 1.0}}])
    with pytest.raises(FileNotFoundError, match="the runs below it: baseline"):
        stabkit.load_run(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        stabkit.load_run(tmp_path / "missing")
    assert load_runs(tmp_path) == []


def test_to_pandas_is_a_step_by_metric_table(tmp_path: Path) -> None:
    rows = [
        {"type": "metrics", "step": 0, "values": {"loss": 3.0}},
        {"type": "metrics", "step": 1, "values": {"loss": 2.0, "grad/global_norm": 0.5}},
    ]
    write_log(tmp_path, rows)
    run = stabkit.load_run(tmp_path)
    try:
        import pandas  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install pandas"):
            run.to_pandas()
        return
    frame = run.to_pandas()
    assert frame.index.tolist() == [0, 1] and frame["loss"].tolist() == [3.0, 2.0]
    assert math.isnan(frame["grad/global_norm"][0]) and frame["grad/global_norm"][1] == 0.5
