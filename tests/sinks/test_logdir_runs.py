"""Two runs in one logdir never mix: a reused logdir gets a ``run-<n>`` subfolder (said on stderr and
in `Monitor.logdir`), or is appended to / overwritten when `MonitorConfig.logdir_mode` says so; the
JSONL logs, the TensorBoard files and `stabkit report` keep each run apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from zoo import batch, lm_loss, reference_gpt

import stabkit
import stabkit.cli.report_cmd  # registers the command
from stabkit.cli import main
from stabkit.sinks import LOG_NAME, read_jsonl


def train(logdir: Path, steps: int, seed: int, **config: object) -> stabkit.Monitor:
    torch.manual_seed(seed)
    model = reference_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = stabkit.MonitorConfig(log_every=2, console=False, **config)  # type: ignore[arg-type]
    with stabkit.attach(model, opt, logdir=logdir, config=cfg) as mon:
        for s in range(steps):
            x, y = batch(seed * 1000 + s)
            loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            mon.step(loss)
            opt.zero_grad()
    return mon


def jsonl_losses(folder: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["values"]["loss"]) for r in read_jsonl(folder / LOG_NAME) if r["type"] == "metrics"]


def tensorboard_losses(folder: Path) -> list[tuple[int, float]]:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # this folder's files only
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars("loss")]


def history_losses(mon: stabkit.Monitor) -> list[tuple[int, float]]:
    return [(s, v["loss"]) for s, v in mon.history]


def same(got: list[tuple[int, float]], expected: list[tuple[int, float]]) -> bool:
    """Same steps in the same order, same losses (TensorBoard stores float32)."""
    return [s for s, _ in got] == [s for s, _ in expected] and [v for _, v in got] == pytest.approx(
        [v for _, v in expected], rel=1e-6
    )


def test_a_reused_logdir_gets_a_run_folder_per_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = train(tmp_path, 4, seed=1)
    assert capsys.readouterr().err == ""  # an empty logdir is used as it is
    second = train(tmp_path, 6, seed=2)
    assert f"this run writes to {tmp_path / 'run-2'}" in capsys.readouterr().err
    third = train(tmp_path, 2, seed=3)
    assert [m.sinks.logdir for m in (first, second, third)] == [
        tmp_path,
        tmp_path / "run-2",
        tmp_path / "run-3",
    ]
    for mon, folder in ((first, tmp_path), (second, tmp_path / "run-2"), (third, tmp_path / "run-3")):
        assert same(jsonl_losses(folder), history_losses(mon))  # each log holds its own run only
        assert same(tensorboard_losses(folder), history_losses(mon))
        assert len(list(folder.glob("events.out.tfevents.*"))) == 1


def test_monitor_logdir_names_the_run_folder(tmp_path: Path) -> None:
    """Needs `Monitor.logdir` to follow `SinkSet.logdir` (stabkit/monitor.py)."""
    train(tmp_path, 2, seed=1)
    assert train(tmp_path, 2, seed=2).logdir == tmp_path / "run-2"


def test_report_lists_each_run_of_a_logdir_separately(tmp_path: Path) -> None:
    train(tmp_path, 4, seed=1)
    train(tmp_path, 6, seed=2)
    from stabkit.harness.recipes.results.report import load_run

    summary = load_run(tmp_path)
    runs = summary.variants
    assert list(runs) == [tmp_path.name, "run-2"]
    assert [r["steps_done"] for r in runs.values()] == [4, 6]
    result = CliRunner().invoke(main, ["report", str(tmp_path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "2 runs, each in its own folder" in result.output
    assert f"\n{tmp_path.name} " in result.output and "\nrun-2 " in result.output
    single = CliRunner().invoke(main, ["report", str(tmp_path / "run-2")], catch_exceptions=False)
    assert single.exit_code == 0 and "\nrun-2 " in single.output


def test_append_mode_continues_the_log_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = train(tmp_path, 4, seed=1)
    second = train(tmp_path, 2, seed=2, logdir_mode="append")
    assert second.sinks.logdir == tmp_path and not (tmp_path / "run-2").exists()
    assert "appending to the run already in" in capsys.readouterr().err
    assert same(jsonl_losses(tmp_path), history_losses(first) + history_losses(second))
    assert [r["mode"] for r in read_jsonl(tmp_path / LOG_NAME) if r["type"] == "run"] == ["new", "append"]
    result = CliRunner().invoke(main, ["report", str(tmp_path)], catch_exceptions=False)
    assert "2 runs appended to one log" in result.output


def test_overwrite_mode_replaces_the_previous_logs(tmp_path: Path) -> None:
    train(tmp_path, 4, seed=1)
    (tmp_path / "notes.txt").write_text("mine")
    second = train(tmp_path, 3, seed=2, logdir_mode="overwrite")
    assert same(jsonl_losses(tmp_path), history_losses(second))
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    assert (tmp_path / "notes.txt").read_text() == "mine"  # only stabkit's files go


def test_other_files_do_not_make_a_logdir_taken(tmp_path: Path) -> None:
    (tmp_path / "config.yaml").write_text("lr: 1")
    (tmp_path / "stabkit-dumps").mkdir()
    assert train(tmp_path, 2, seed=1).sinks.logdir == tmp_path


def test_bad_logdir_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="logdir_mode must be one of new, append, overwrite"):
        stabkit.MonitorConfig(logdir_mode="reuse")
