"""Long commands show where they are: `Phase` (a live line on a terminal, plain lines otherwise),
`MultiProgress`'s overall line, bench's progress and memory-phase estimate, `bench --quick`."""

from __future__ import annotations

import io
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from stabkit.bench import BenchConfig
from stabkit.bench.memory import ProcessClock, memory_plan
from stabkit.bench.report import time_verdict
from stabkit.cli import main
from stabkit.cli.progress import MultiProgress, Phase, duration


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_duration() -> None:
    assert [duration(s) for s in (0, 9.6, 65, 3725, -3)] == ["0s", "10s", "1m05s", "1h02m", "0s"]


def test_phase_plain_lines_one_per_quarter_and_phase() -> None:
    out = io.StringIO()
    with Phase("timing", 8, stream=out, unit="steps") as phase:
        for i in range(8):
            phase.begin(f"block {i}")
            phase.update(1)
    lines = out.getvalue().splitlines()
    assert lines[0] == "timing: started (8 steps to do)"
    assert len(lines) == 6, lines  # start, four quarters, end
    assert lines[1].startswith("timing: 2/8 steps, finished block 1 (") and "left)" in lines[1]
    assert lines[4].startswith("timing: 8/8 steps, finished block 7") and lines[4].endswith("done)")
    assert lines[5].startswith("timing: done in ")
    assert "\x1b" not in out.getvalue() and "\r" not in out.getvalue()


def test_phase_plain_lines_per_unit_and_item() -> None:
    out = io.StringIO()
    with Phase("memory", 3, stream=out, unit="processes", log_units=True, eta=lambda d: 10.0 * (3 - d)) as p:
        for name in ("bare", "bare again", "full"):
            p.begin(name)
            p.update(1)
    lines = out.getvalue().splitlines()
    assert len(lines) == 5, lines  # start, three units, end
    assert "1/3 processes, finished bare" in lines[1] and "~20s left" in lines[1]
    assert "~10s left" in lines[2]

    out = io.StringIO()
    with Phase("reading", 100, stream=out, log_items=True) as p:
        p.update(100)
        p.begin("summarising 7 steps")
    assert "reading: summarising 7 steps (100/100, " in out.getvalue()


def test_phase_live_line_on_a_terminal() -> None:
    out = Terminal()
    phase = Phase("memory", 4, stream=out, eta=lambda done: 30.0, tick=False)
    phase.begin("full")
    phase.update(1)
    phase.close()
    phase.close()  # twice is safe
    text = out.getvalue()
    assert "\r\x1b[2K" in text and text.endswith("\n") and text.count("\n") == 1
    assert "memory [######------------------] 1/4 full" in text and "left" in text
    assert "started" not in text


class Redraws(Terminal):
    """A terminal that says when a line is redrawn from another thread (the ticker's)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_ticker = threading.Event()

    def write(self, text: str) -> int:
        if "\r" in text and threading.current_thread().name == "stabkit-progress":
            self.by_ticker.set()
        return super().write(text)


def test_phase_ticker_redraws_during_a_long_unit() -> None:
    out = Redraws()
    with Phase("long", 2, stream=out) as phase:
        phase.begin("unit 1")
        # nothing else happens in this unit: only the ticker can redraw the line (once a second)
        assert out.by_ticker.wait(timeout=30), "the ticker did not redraw the line"
    assert out.getvalue().endswith("\n")


def test_phase_time_left_counts_down_from_the_last_estimate() -> None:
    phase = Phase("x", 2, stream=io.StringIO(), eta=lambda done: 100.0)
    assert phase.time_left() is None
    phase.update(1)
    left = phase.time_left()
    assert left is not None and 99.0 < left <= 100.0
    phase.close()


def test_multiprogress_overall_line() -> None:
    out = io.StringIO()
    bars = MultiProgress(["a", "b"], 4, stream=out)
    bars.update("a", "start", 0, 4, float("nan"))
    for step in range(1, 5):
        bars.update("a", "step", step, 4, 3.0)
    bars.update("a", "done", 4, 4, 3.0)
    assert "1/2 runs finished" in out.getvalue() and "left" in out.getvalue()
    left = bars.time_left()
    assert left is not None and left >= 0
    bars.update("b", "start", 0, 4, float("nan"))
    bars.update("b", "failed", 1, 4, float("nan"))
    assert "2/2 runs finished" in out.getvalue().splitlines()[-1] and bars.time_left() == 0


def test_multiprogress_on_a_short_terminal_shows_running_and_latest(monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback=(0, 0): os.terminal_size((80, 6)))
    out = Terminal()
    names = [f"run{i}" for i in range(10)]
    bars = MultiProgress(names, 10, stream=out)
    for name in names[:3]:
        bars.update(name, "start", 0, 10, float("nan"))
        bars.update(name, "done", 10, 10, 2.0)
    bars.update("run3", "start", 0, 10, float("nan"))
    bars.close()
    last = out.getvalue().rsplit("\x1b[J", 1)[-1]
    assert "run3" in last and "run2" in last and "run9" not in last
    assert "not shown: 6 waiting, 1 finished" in last
    assert bars.drawn <= 4


def test_process_clock_fits_fixed_and_per_step_cost() -> None:
    cfg = BenchConfig(steps=10, repeats=1, warmup=2)
    assert memory_plan(cfg) == ["bare", "bare", "default", "full", "anomaly"]
    step = {"bare": 0.1, "default": 0.11, "full": 0.2, "anomaly": 0.3}
    clock = ProcessClock(cfg, step, startup=3.0)
    assert clock.remaining(0) > 5 * 6.0  # the guess: twice the start-up plus the steps
    truth = {v: 5.0 + 50.0 * s for v, s in step.items()}  # fixed 5 s, 50 step-equivalents
    clock.finished("bare", truth["bare"])
    assert clock.seconds("bare") == pytest.approx(truth["bare"])
    clock.finished("bare", truth["bare"])
    clock.finished("default", truth["default"])
    assert clock.remaining(3) == pytest.approx(truth["full"] + truth["anomaly"])
    assert clock.remaining(5) == 0


def test_memory_phase_reports_each_process(monkeypatch: pytest.MonkeyPatch) -> None:
    from stabkit.bench import memory

    sizes = {"bare": iter([(100, 1000), (110, 1004)]), "default": iter([(150, 1010)])}
    monkeypatch.setattr(memory, "measure_in_subprocess", lambda cfg, v: next(sizes[v]))
    calls: list[tuple[str, Any]] = []

    class Recorder:
        def begin(self, item: str) -> None:
            calls.append(("begin", item))

        def update(self, n: int = 1) -> None:
            calls.append(("update", n))

    cfg = BenchConfig(variants=("bare", "default"))
    clock = ProcessClock(cfg, {"bare": 0.1, "default": 0.2}, startup=1.0)
    out = memory.cpu_memory_overheads(cfg, progress=Recorder(), clock=clock)
    assert out["rss"] == {"bare": 0, "noise": 10, "default": 50}
    assert out["tensor"] == {"bare": 0, "noise": 4, "default": 10}
    assert [c for c in calls if c[0] == "begin"] == [
        ("begin", "bare"),
        ("begin", "bare again (noise)"),
        ("begin", "default"),
    ]
    assert calls.count(("update", 1)) == 3 and len(clock.done) == 3


def test_time_verdict_with_noise() -> None:
    assert time_verdict(1.02, 1.03, None) == "ok"
    assert time_verdict(1.05, 1.03, 0.03) == "within noise"
    assert time_verdict(1.05, 1.03, 0.01) == "OVER"
    assert time_verdict(1.05, 1.03, None) == "OVER"


def test_bench_quick_states_its_noise_band_and_skips_memory(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(
        main,
        ["bench", "--quick", "--size", "tiny", "--repeats", "2", "--json", str(out)],
        standalone_mode=False,
    )
    assert result.exit_code == 0, result.output
    assert "quick: 2 rounds of 10 steps and no memory phase" in result.stdout
    assert "noise: of the CPU-time ratio, half the spread of 2 rounds;" in result.stdout
    assert "memory:" not in result.stderr  # no memory phase
    lines = result.stderr.splitlines()  # not a terminal: plain lines
    assert lines[0] == "timing 2 rounds x 4 variants: started (88 steps to do)"  # 4 x (2 + 2 x 10)
    assert lines[-1].startswith("timing 2 rounds x 4 variants: done in ")
    data = json.loads(out.read_text())
    assert data["config"]["quick"] is True and data["config"]["steps"] == 10
    for name in ("default", "full", "anomaly"):
        row = data["variants"][name]
        assert row["memory_overhead_bytes"] is None and row["ratio_noise"] is not None
