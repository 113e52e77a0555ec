"""`stabkit report` on large logs: bytes-read progress, one read per log, a linear-time smoothed loss."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

import stabkit.cli.report_cmd as report_cmd
from stabkit.cli import main
from stabkit.harness.recipes.results import report
from stabkit.harness.recipes.results.measures import best_smoothed
from stabkit.sinks import LOG_NAME, read_jsonl


def write_log(folder: Path, steps: int, events: tuple[int, ...] = ()) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for s in range(steps):
        values: dict[str, Any] = {"loss": 5.0 - s / steps, "attn/blocks.0.attn/max_logit": 3.0 + s}
        if s == 3:
            values["loss"] = "nan"
        lines.append(json.dumps({"type": "metrics", "step": s, "values": values}))
        if s in events:
            lines.append(
                json.dumps({"type": "event", "step": s, "kind": "spike", "where": "loss", "message": "m"})
            )
    path = folder / LOG_NAME
    path.write_text("\n".join(lines) + '\n{"type": "metr', encoding="utf-8")  # a torn last line
    return path


class Recorder:
    def __init__(self) -> None:
        self.items: list[str] = []
        self.bytes = 0

    def begin(self, item: str) -> None:
        self.items.append(item)

    def update(self, n: int = 1) -> None:
        self.bytes += n


def test_read_log_reads_like_read_jsonl_and_counts_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_log(tmp_path, 300, events=(10, 20))
    monkeypatch.setattr(report, "CHUNK", 1000)
    rec = Recorder()
    rows = report.read_log(path, rec)
    expected = read_jsonl(path)
    assert len(rows) == len(expected) == 302
    assert json.dumps(rows, default=str) == json.dumps(expected, default=str)  # nan as float in both
    assert math.isnan(rows[3]["values"]["loss"])
    assert rec.bytes == path.stat().st_size


def test_single_log_is_read_once_with_progress(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_log(tmp_path / "run", 200, events=(5, 50, 150))
    reads: list[Path] = []
    original = report.read_log
    monkeypatch.setattr(
        report, "read_log", lambda p, progress=None: reads.append(Path(p)) or original(p, progress)
    )
    rec = Recorder()
    summary = report.load_run(tmp_path / "run", progress=rec)
    text = report.events_text(summary)
    assert len(reads) == 1, "the events of a single log come with its metrics"
    assert "run: 3 event(s)" in text
    assert rec.items == ["summarising 200 steps"]
    assert summary.variants["run"]["steps_done"] == 200
    assert report.single_log(tmp_path / "run") == tmp_path / "run" / LOG_NAME


def test_report_shows_progress_for_large_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_log(tmp_path / "run", 500, events=(7,))
    quiet = CliRunner().invoke(main, ["report", str(tmp_path / "run")], standalone_mode=False)
    assert quiet.exit_code == 0, quiet.output
    assert quiet.stderr == ""  # small logs: no progress lines
    monkeypatch.setattr(report_cmd, "LARGE", 1)
    loud = CliRunner().invoke(main, ["report", str(tmp_path / "run")], standalone_mode=False)
    assert loud.exit_code == 0, loud.output
    assert loud.stdout == quiet.stdout
    lines = loud.stderr.splitlines()
    assert lines[0].startswith("reading ") and lines[0].endswith("to do)")
    assert any("summarising 500 steps" in line for line in lines)
    assert lines[-1].startswith("reading ") and " done in " in lines[-1]


def test_report_of_a_run_reads_each_variant_log_with_progress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    variants = {}
    for name, events in (("baseline", (3, 4)), ("qk_norm", ())):
        write_log(tmp_path / name, 50, events=events)
        variants[name] = {"status": "done", "logdir": str(tmp_path / name), "steps_done": 50}
    (tmp_path / "summary.json").write_text(
        json.dumps({"kind": "run", "recipe": "r", "complete": True, "variants": variants, "verdicts": {}})
    )
    monkeypatch.setattr(report_cmd, "LARGE", 1)
    result = CliRunner().invoke(main, ["report", str(tmp_path)], standalone_mode=False)
    assert result.exit_code == 0, result.output
    assert "baseline: 2 event(s)" in result.stdout and "qk_norm: 0 event(s)" in result.stdout
    assert "reading the events" in result.stderr and "qk_norm" in result.stderr


def best_smoothed_by_definition(losses: list[float]) -> float:
    """The lowest mean over every window of len // 20 values with no non-finite value."""
    if not losses:
        return math.nan
    w = max(1, len(losses) // 20)
    means = [
        sum(losses[i : i + w]) / w
        for i in range(len(losses) - w + 1)
        if all(math.isfinite(v) for v in losses[i : i + w])
    ]
    return min(means) if means else math.nan


def test_best_smoothed_matches_its_definition() -> None:
    rng = random.Random(0)
    specials = (math.nan, math.inf, -math.inf)
    for _ in range(400):
        n = rng.randint(0, 400)
        losses = [rng.choice(specials) if rng.random() < 0.02 else rng.gauss(3, 1) for _ in range(n)]
        got, want = best_smoothed(losses), best_smoothed_by_definition(losses)
        assert got == want or (math.isnan(got) and math.isnan(want)), (n, got, want)
