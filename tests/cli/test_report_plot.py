"""`stabkit report LOGDIR --plot OUT` draws a user's own run (the panels, the injected event marked in
its severity's colour, the advice under them); exit 2 with one line for a missing logdir or a missing
matplotlib; the report's table drops the columns a user's run never fills and says what the others
mean; incidents one line each (their events with --members); `stabkit demo` prints what it found."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from zoo import batch, lm_loss, reference_gpt

import stabkit
import stabkit.cli.demo_cmd  # registers the commands
import stabkit.cli.report_cmd
from stabkit.cli import main
from stabkit.cli.plot_run import plot_report
from stabkit.harness.recipes.results.report import load_run as load_summary
from stabkit.sinks.plot import SEVERITY_COLORS

SPIKE = 24


@pytest.fixture(scope="module")
def logdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A user's run of the tiny GPT: the loss multiplied by 1000 at step `SPIKE` (found as a spike)."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("user-run")
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    detect = stabkit.DetectConfig(options={"spike": {"min_history": 8, "window": 16}})
    cfg = stabkit.MonitorConfig(log_every=5, every=2, console=False, detect=detect, attn_per_head=True)
    with stabkit.attach(model, opt, logdir=folder, config=cfg) as mon:
        for s in range(30):
            x, y = batch(s)
            loss = lm_loss(model(x), y)
            loss = loss * 1000 if s == SPIKE else loss
            loss.backward()
            opt.step()
            mon.step(loss)
            opt.zero_grad()
    assert mon.events and min(e.step for e in mon.events) == SPIKE
    return folder


def test_plot_draws_the_panels_and_marks_the_event(logdir: Path, tmp_path: Path) -> None:
    out = tmp_path / "run.png"
    fig = plot_report(load_summary(logdir), logdir, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert titles[0] == "loss" and titles[1].startswith("gradient norm")
    run = stabkit.load_run(logdir)
    # the attention panel names the layer with the largest logit logged, and its largest head
    layers = {
        m.split("/")[1]: run.series(m).values.max() for m in run.metrics if m.endswith("attn/max_logit")
    }
    layers = {k: v for k, v in layers.items() if "head." not in k}
    top = max(layers, key=lambda k: layers[k])
    heads = {
        m.split("/head.")[1].split("/")[0]: run.series(m).values.max()
        for m in run.metrics
        if m.startswith(f"attn/{top}/head.") and m.endswith("/max_logit")
    }
    assert titles[2].endswith(f": {top} head {max(heads, key=lambda k: heads[k])}"), titles[2]
    assert titles[3].startswith("log Z") and titles[4].startswith("activation RMS, largest block")
    assert titles[4].split(": ")[-1] in {"blocks.0", "blocks.1"}
    assert titles[5].startswith("events") and "what to do" in titles[6]
    # the loss panel: its curve is the logged loss, and a vertical line in the warning colour at the spike
    loss_ax = fig.axes[0]
    curve = [ln for ln in loss_ax.lines if len(ln.get_xdata()) > 2]
    assert list(curve[0].get_ydata()) == pytest.approx(run.series("loss").values.tolist())
    marks = [ln for ln in loss_ax.lines if list(ln.get_xdata()) == [SPIKE, SPIKE]]
    assert marks and marks[0].get_color() == SEVERITY_COLORS["warning"]
    assert loss_ax.get_yscale() == "log"  # the 1000x spike spans decades
    advice = fig.axes[6].texts[0].get_text()
    assert f"step {SPIKE} [spike, warning" in advice and run.events[0].advice[:40] in advice


def test_report_plot_from_the_command_line(logdir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli.png"
    result = CliRunner().invoke(main, ["report", str(logdir), "--plot", str(out)])
    assert result.exit_code == 0, result.output
    assert out.stat().st_size > 10_000 and f"plot: {out}" in result.output


def test_report_text_legend_columns_and_incidents(logdir: Path) -> None:
    result = CliRunner().invoke(main, ["report", str(logdir)])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    header = next(line for line in lines if line.startswith("variant"))
    # a user's run has no held-out loss, bigram level or verdict: those columns are left out
    for gone in ("val", "mean logit", "above bigram", "verdict"):
        assert gone not in header.split("  "), header
    assert "final" in header and "first event" in header
    legend = lines[lines.index("columns:") :]
    assert any(
        line.split()[0] == "final" and "mean of the last 10 % of logged steps" in line for line in legend
    )
    # one line per incident; its events only with --members
    run = stabkit.load_run(logdir)
    assert run.incidents
    for incident in run.incidents:
        assert sum(incident["headline"] in line for line in lines) == 1
    assert not any(line.startswith(f"        step {SPIKE}: [spike]") for line in lines)
    members = CliRunner().invoke(main, ["report", str(logdir), "--members"]).output.splitlines()
    listed = [line for line in members if line.startswith("        step ")]
    assert len(listed) == len(run.events)


def test_report_plot_bad_input_exits_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logdir: Path) -> None:
    missing = CliRunner().invoke(main, ["report", str(tmp_path / "nope"), "--plot", str(tmp_path / "x.png")])
    assert missing.exit_code == 2 and "does not exist" in missing.output
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # as if matplotlib were not installed
    result = CliRunner().invoke(main, ["report", str(logdir), "--plot", str(tmp_path / "x.png")])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "stabkit: error: drawing a run needs matplotlib: pip install 'stabkit[plot]'"
    ]
    assert not (tmp_path / "x.png").exists()


def test_demo_prints_the_events_it_found(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    folder = tmp_path / "demo"
    args = ["demo", "--steps", "50", "--lr", "0.05", "--logdir", str(folder)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    run = stabkit.load_run(folder)
    assert run.events, "lr 0.05 collapses an attention head's entropy within 50 steps"
    assert f"events: {len(run.events)} in {len(run.incidents)} incident(s)" in result.output
    for incident in run.incidents:
        assert incident["headline"] in result.output
    for advice in {e.advice for e in run.events if e.advice}:
        assert f"advice: {advice}" in result.output
