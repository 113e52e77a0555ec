"""A Monitor printed (or shown in a notebook) says its state, step, logdir, what it watches, the newest
values and the newest events with their severity."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from zoo import reference_gpt, train_steps

import stabkit
from stabkit.events import Event


def _monitor(tmp_path: Path) -> tuple[stabkit.Monitor, list[float]]:
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = stabkit.MonitorConfig(every=4, attn_every=2, log_every=50, console=False, tensorboard=False)
    mon = stabkit.attach(model, opt, logdir=tmp_path, config=cfg)
    return mon, train_steps(model, opt, mon, 3)


def _event(step: int, severity: str, where: str = "loss") -> Event:
    return Event(step, "spike", where, 9.0, 3.0, f"jump {step}", advice="lower the LR", severity=severity)


def test_repr_says_the_runs_state_and_newest_events(tmp_path: Path) -> None:
    mon, losses = _monitor(tmp_path)
    for step, sev in enumerate(["info", "warning", "warning", "critical", "info", "warning", "critical"]):
        mon.report(_event(step, sev))
    lines = repr(mon).splitlines()
    rows = {line.split()[0]: line.split(None, 1)[1] for line in lines[1:9]}
    assert rows["state"] == "attached" and rows["step"] == "3"
    assert rows["logdir"] == str(mon.logdir)
    assert rows["model"] == "GPT (stabkit-gpt, 2 blocks)"
    assert "per-layer every 4, attention every 2; written every 50" in rows["watching"]
    assert rows["newest"].startswith(f"loss {losses[-1]:.4g}, grad norm ")
    assert rows["events"] == "7 (2 critical, 3 warning, 2 info)"
    listed = [line.strip() for line in lines if line.startswith("    step ")]
    assert [line.split()[1] for line in listed] == ["2", "3", "4", "5", "6"]  # the newest five
    assert [line.split()[2] for line in listed] == ["warning", "critical", "info", "warning", "critical"]
    assert listed[-1].endswith("[spike] loss: jump 6 -> try: lower the LR")
    mon.detach()
    assert repr(mon).splitlines()[1].split() == ["state", "detached"]


def test_repr_html_escapes_and_colours_severity(tmp_path: Path) -> None:
    mon, _ = _monitor(tmp_path)
    mon.report(_event(1, "critical", where="blocks.<0>"))
    page = mon._repr_html_()
    assert page.startswith("<div><b>stabkit.Monitor</b><table>")
    assert "<code>blocks.&lt;0&gt;</code>" in page and "blocks.<0>" not in page
    assert "color:#cf222e;font-weight:bold'>critical</span> step 1" in page
    assert "<th style='text-align:left;padding-right:1em'>step</th><td style='text-align:left'>3</td>" in page
    mon.detach()


def test_repr_of_a_disabled_monitor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STABKIT_DISABLE", "1")
    mon = stabkit.attach(reference_gpt())
    mon.step()
    assert repr(mon).splitlines()[1:3] == ["  state   disabled (STABKIT_DISABLE)", "  step    1"]
