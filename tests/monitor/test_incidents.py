"""Incidents: events of one cause grouped (by hand-made events and on a real LR blow-up), the console's
one line per incident, severities in the JSONL log, and actions acting on warnings only."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from zoo import EncoderLM

import stabkit
from stabkit.events import Event
from stabkit.incidents import IncidentLog
from stabkit.sinks.console import ConsoleSink

from ..detectors.helpers import text_batches


def ev(step: int, where: str, severity: str = "warning", since: int | None = None) -> Event:
    details = {} if since is None else {"since": since}
    return Event(step, "spike", where, 1.0, 0.5, f"{where} jumped", details=details, severity=severity)


def test_events_within_the_gap_share_an_incident_and_later_ones_open_another() -> None:
    log = IncidentLog(gap=3)
    first = [ev(80, "grad/blocks.0/norm", "info"), ev(80, "loss"), ev(82, "grad/global_norm", "info")]
    shown = [log.file(e)[1] for e in first]
    assert shown == [True, True, False]  # opened (a note), raised to a warning, joined quietly
    late = ev(90, "loss")
    assert log.file(late)[1] is True
    assert [e.details["incident"] for e in [*first, late]] == [1, 1, 1, 2]
    one = log.incidents[0]
    assert (one.first_step, one.last_step, one.severity) == (80, 82, "warning")
    assert one.first.where == "grad/blocks.0/norm" and len(one.members) == 3
    record = one.to_dict()
    assert record["members"] == 3 and record["kinds"] == ["spike"] and record["first"] == "grad/blocks.0/norm"
    assert record["series"] == ["grad/blocks.0/norm", "loss", "grad/global_norm"]
    assert "incident 1 at steps 80–82" in record["headline"] and "+2 more events" in record["headline"]


def test_the_first_mover_is_where_the_trouble_began() -> None:
    log = IncidentLog()
    log.file(ev(100, "loss"))
    log.file(ev(101, "act/blocks.2/rms", since=60))  # a drift whose window began at step 60
    assert log.incidents[0].first.where == "act/blocks.2/rms"
    with pytest.raises(ValueError, match="gap"):
        IncidentLog(gap=-1)


def test_console_prints_one_line_per_incident_and_again_when_it_turns_worse() -> None:
    out = io.StringIO()
    console = ConsoleSink(out)
    log = IncidentLog()
    for event in [ev(5, "grad/a", "info"), ev(5, "grad/b", "info"), ev(6, "loss"), ev(6, "grad/c")]:
        log.file(event)
        console.write_event(event)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("[stabkit] INFO step 5 [spike] grad/a") and lines[0].endswith("(incident 1)")
    assert lines[1].startswith("[stabkit] WARNING step 6 [spike] loss")


def lr_blowup(
    tmp_path: Path, detect: stabkit.DetectConfig | None = None
) -> tuple[stabkit.Monitor, str, list[float]]:
    """A post-norm encoder (warmup then a steady LR) whose LR is multiplied by 300 at step 80."""
    torch.manual_seed(0)
    model = EncoderLM(d=32, n_layer=2, vocab=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    err = io.StringIO()
    cfg = stabkit.MonitorConfig(
        every=1, log_every=10, tensorboard=False, detect=detect or stabkit.DetectConfig()
    )
    mon = stabkit.attach(model, opt, logdir=tmp_path, config=cfg)
    losses = []
    import contextlib

    with contextlib.redirect_stderr(err):
        for step, (x, y) in enumerate(text_batches(100, 8, 32, seed=0)):
            for g in opt.param_groups:
                g["lr"] = 1e-3 * min(1.0, (step + 1) / 20) * (300 if step >= 80 else 1)
            loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
            loss.backward()
            opt.step()
            mon.step(loss)
            opt.zero_grad()
            losses.append(loss.item())
        mon.detach()
    return mon, err.getvalue(), losses


def test_an_lr_blowup_is_one_incident_on_the_console_and_every_event_in_the_log(tmp_path: Path) -> None:
    mon, err, losses = lr_blowup(tmp_path)
    assert max(losses[80:85]) > 2 * losses[79]  # the blow-up happened
    at_blowup = [e for e in mon.events if 80 <= e.step <= 85]
    assert len(at_blowup) >= 5  # the loss, the LR jump, gradient norms, update norms...
    incidents = {e.details["incident"] for e in at_blowup}
    assert len(incidents) == 1
    incident = mon.incidents.incidents[next(iter(incidents)) - 1]
    assert incident.severity in ("warning", "critical") and incident.first_step == 80
    event_lines = [
        line for line in err.splitlines() if " step 8" in line and "[stabkit] " in line and "[" in line[10:]
    ]
    printed = [
        line
        for line in event_lines
        if line.startswith(("[stabkit] INFO", "[stabkit] WARNING", "[stabkit] CRITICAL"))
    ]
    assert 1 <= len(printed) <= 3, printed  # one line per incident (+1 per rise of severity)
    assert all(len(line) < 400 for line in printed)
    rows = [json.loads(line) for line in (Path(mon.logdir) / "stabkit.jsonl").read_text().splitlines()]
    logged = [r for r in rows if r.get("type") == "event"]
    assert {r["id"] for r in rows if r.get("type") == "incident"} >= incidents
    assert len(logged) >= len(at_blowup)
    assert {r["severity"] for r in logged} <= {"info", "warning", "critical"}


def test_actions_act_on_warnings_and_leave_notes_alone() -> None:
    """A gradient spike alone is a note: reported, not rolled back, unless act_on='info'; then 'skip'
    skips it. ('skip' on spikes with act_on='warning' could never act, so that config is refused.)"""

    def acted(action: str, act_on: str) -> list[tuple[int, str, bool]]:
        det = stabkit.DetectConfig(
            actions={"spike": action}, act_on=act_on, options={"rollback": {"snapshot_every": 5}}
        )
        torch.manual_seed(0)
        model = EncoderLM(d=32, n_layer=2, vocab=256)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        cfg = stabkit.MonitorConfig(
            every=1, log_every=10, console=False, tensorboard=False, jsonl=False, detect=det
        )
        mon = stabkit.attach(model, opt, config=cfg)
        for step, (x, y) in enumerate(text_batches(40, 8, 32, seed=0)):
            loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
            (loss * (30.0 if step == 30 else 1.0)).backward()  # gradients ×30, the loss as it was
            opt.step()
            mon.step(loss)
            opt.zero_grad()
        mon.detach()
        return [
            (e.step, e.severity, bool(e.details.get("skipped_update") or e.details.get("rollback")))
            for e in mon.events
            if e.kind == "spike"
        ]

    notes = acted("rollback", "warning")
    assert notes and all(sev == "info" and not done for _, sev, done in notes)
    assert any(step == 30 for step, _, _ in notes)
    skipped = acted("skip", "info")
    assert any(step == 30 and done for step, _, done in skipped)
    with pytest.raises(ValueError, match="act_on='info'"):
        stabkit.DetectConfig(actions={"spike": "skip"}, act_on="warning")
    with pytest.raises(ValueError, match="act_on"):
        stabkit.DetectConfig(act_on="loud")
