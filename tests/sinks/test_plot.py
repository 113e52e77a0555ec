"""`plot_runs` on hand-written logs: several runs one colour each, each run's events as dots on its own
curve in their severity's colour, panels with nothing logged say so, the advice lists each advice once, with the runs and steps it came from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("matplotlib")

import stabkit
from stabkit.sinks import LOG_NAME
from stabkit.sinks.plot import RUN_COLORS, SEVERITY_COLORS, plot_runs


def event(step: int, severity: str, advice: str) -> dict[str, Any]:
    return {"type": "event", "step": step, "kind": "spike", "where": "loss", "value": 9.0, "threshold": 5.0,
            "message": "m", "advice": advice, "details": {}, "severity": severity}  # fmt: skip


def write_run(folder: Path, losses: list[float], events: list[dict[str, Any]]) -> stabkit.sinks.Run:
    folder.mkdir(parents=True)
    rows = [
        {"type": "metrics", "step": s, "values": {"loss": v, "grad/global_norm": 1.0}}
        for s, v in enumerate(losses)
    ]
    (folder / LOG_NAME).write_text("".join(json.dumps(r) + "\n" for r in rows + events), encoding="utf-8")
    return stabkit.load_run(folder)


def test_several_runs_dots_on_their_own_curves(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a", [3.0, 2.0, 9.0, 1.5], [event(2, "critical", "lower the LR")])
    b = write_run(
        tmp_path / "b", [3.0, 2.5, 2.0, 1.8], [event(1, "info", "lower the LR"), event(3, "warning", "clip")]
    )
    fig = plot_runs([a, b], tmp_path / "two.svg")
    assert (tmp_path / "two.svg").read_text().lstrip().startswith("<?xml")
    loss = fig.axes[0]
    curves = {ln.get_label(): ln for ln in loss.lines if len(ln.get_xdata()) > 1}
    assert curves["a"].get_color() == RUN_COLORS[0] and curves["b"].get_color() == RUN_COLORS[1]
    dots = {
        (float(ln.get_xdata()[0]), float(ln.get_ydata()[0])): ln.get_color()
        for ln in loss.lines
        if len(ln.get_xdata()) == 1
    }
    assert dots == {
        (2.0, 9.0): SEVERITY_COLORS["critical"],  # on a's curve, at its value there
        (1.0, 2.5): SEVERITY_COLORS["info"],
        (3.0, 1.8): SEVERITY_COLORS["warning"],
    }
    # nothing about attention, log Z or activations in these logs: those panels say so
    empty = [ax.texts[0].get_text() for ax in fig.axes[2:5]]
    assert empty == ["no attention logits logged", "not logged", "no block activations logged"]
    advice = fig.axes[6].texts[0].get_text().splitlines()
    assert advice == [  # each advice once, with the runs and steps it came from
        "a step 2, b step 1 [spike, critical, 2 event(s)]: lower the LR",
        "b step 3 [spike, warning, 1 event(s)]: clip",
    ]
    # one legend of the runs' colours, on the loss panel
    assert fig.axes[1].get_legend() is None and fig.axes[0].get_legend() is not None


def test_no_run_is_an_error() -> None:
    with pytest.raises(ValueError, match="no run to draw"):
        plot_runs([])
