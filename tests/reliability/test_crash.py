"""Nothing lost on a crash: SIGTERM, SIGINT and an exception outside `with` leave complete logs."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_process import interruptible

from stabkit.sinks import LOG_NAME, read_jsonl

WORKER = str(Path(__file__).parents[1] / "crash_worker.py")

pytestmark = pytest.mark.multiprocess


def logged_steps(logdir: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(logdir / LOG_NAME) if r["type"] == "metrics"]


@pytest.mark.signals
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_mid_run_leaves_logs_up_to_the_last_finished_step(sig: signal.Signals, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, WORKER, str(tmp_path), "loop"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=interruptible,
    )
    assert proc.stdout is not None
    last = -1
    for line in proc.stdout:
        last = int(line.split()[1])
        if last >= 6:
            break
    proc.send_signal(sig)
    rest, err = proc.communicate(timeout=120)
    for line in rest.splitlines():
        last = int(line.split()[1])
    assert proc.returncode == -sig, err  # the process still dies of the signal, as without stabkit
    steps = logged_steps(tmp_path)
    # every finished step is there, in order; at most the step in flight when the signal came is extra
    assert steps[: last + 1] == list(range(last + 1))
    assert len(steps) <= last + 2
    assert any(p.name.startswith("events.out.tfevents") and p.stat().st_size > 0 for p in tmp_path.iterdir())


def test_exception_outside_with_block_is_flushed_at_exit(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, WORKER, str(tmp_path), "raise"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and "user code failed" in proc.stderr
    assert logged_steps(tmp_path) == [0, 1, 2, 3, 4]
