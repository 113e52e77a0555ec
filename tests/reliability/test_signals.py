"""SIGTERM and the user's own handler: the preemption pattern (flag → finish the step → checkpoint →
exit 0) works with stabkit attached; the monitors stay usable, and the log holds the last step.
SIGTERM to `stabkit run` stops every worker and leaves a summary that says "interrupted"."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from cli_process import StabkitCLI, child_env, logged, wait_until

from stabkit.sinks import LOG_NAME, read_jsonl

pytestmark = [pytest.mark.multiprocess, pytest.mark.signals]

SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from zoo import batch, lm_loss, reference_gpt
    import stabkit

    torch.set_num_threads(1)
    logdir, ckpt, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    stop = False

    def on_term(signum, frame):
        global stop
        stop = True

    signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "ignore" else on_term)
    model = reference_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    cfg = stabkit.MonitorConfig(every=1, log_every=1000, console=False)
    mon = stabkit.attach(model, opt, logdir=logdir, config=cfg)
    for step in range(1000):
        x, y = batch(step)
        loss = lm_loss(model(x), y)
        loss.backward()
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # preempted mid-step, after backward
        opt.step()
        mon.step(loss)  # the step is finished: the monitor must still be attached
        opt.zero_grad()
        if mode == "ignore" and step == 7:
            stop = True
        if stop:
            torch.save({"model": model.state_dict(), "stabkit": mon.state_dict(), "step": step}, ckpt)
            print("checkpoint", step, flush=True)
            if mode == "os_exit":
                os._exit(0)  # nothing runs at exit: the log must already hold the last step
            sys.exit(0)
    """
)


def logged_steps(logdir: Path) -> list[int]:
    return [r["step"] for r in read_jsonl(logdir / LOG_NAME) if r["type"] == "metrics"]


@pytest.mark.parametrize("mode", ["exit", "os_exit", "ignore"])
def test_user_sigterm_handler_finishes_the_step_checkpoints_and_exits_0(tmp_path: Path, mode: str) -> None:
    script = tmp_path / "preempt.py"
    script.write_text(SCRIPT)
    logdir, ckpt = tmp_path / "logs", tmp_path / "ckpt.pt"
    proc = subprocess.run(
        [sys.executable, str(script), str(logdir), str(ckpt), mode],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
        env=child_env(tests=True),  # the script imports tests/zoo.py
    )
    assert proc.returncode == 0, proc.stderr
    assert "after detach" not in proc.stderr
    last = 7 if mode == "ignore" else 5
    assert f"checkpoint {last}" in proc.stdout
    saved = torch.load(ckpt, weights_only=False)
    assert saved["step"] == last and saved["stabkit"]["step"] == last + 1
    assert logged_steps(logdir) == list(range(last + 1))  # the last finished step is in the log


def start_run(cli: StabkitCLI, out: Path, jobs: int) -> tuple[subprocess.Popen[str], list[Path]]:
    """`stabkit run` on a long recipe, returned once every worker has logged some steps."""
    proc = cli.start(
        "run", "attention-logit-growth", "--steps", "3000", "--jobs", str(jobs), "--out", str(out)
    )
    logs = [out / name / LOG_NAME for name in ("baseline", "qk_norm")[:jobs]]
    wait_until(logged(*logs))
    assert proc.poll() is None, proc.communicate()
    return proc, logs


@pytest.mark.parametrize("jobs", [2, 1])
def test_sigterm_to_stabkit_run_stops_every_worker_and_leaves_an_interrupted_summary(
    tmp_path: Path, jobs: int, stabkit_cli: StabkitCLI
) -> None:
    import psutil

    out = tmp_path / "run"
    proc, logs = start_run(stabkit_cli, out, jobs)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert len(children) >= (jobs if jobs > 1 else 0)  # the training workers are running
    os.kill(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr
    _, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, [p.cmdline() for p in alive]  # no worker trains on as an orphan
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["complete"] is False
    assert summary["stopped_by"] == "SIGTERM"
    statuses = {n: r["status"] for n, r in summary["variants"].items()}
    assert statuses["baseline"] == "interrupted" and set(statuses.values()) <= {"interrupted", "not run"}
    for path in logs:
        steps = [r["step"] for r in read_jsonl(path) if r["type"] == "metrics"]
        assert steps and steps == list(range(len(steps)))  # flushed up to the step it stopped at
    assert "PARTIAL: interrupted" in stdout


def test_workers_of_a_killed_stabkit_run_stop_and_exit(tmp_path: Path, stabkit_cli: StabkitCLI) -> None:
    """SIGKILL cannot be caught: the workers notice their parent is gone, stop and exit."""
    import psutil

    proc, logs = start_run(stabkit_cli, tmp_path / "run", 2)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    proc.communicate(timeout=60)
    _, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, [p.cmdline() for p in alive]
    for path in logs:
        steps = [r["step"] for r in read_jsonl(path) if r["type"] == "metrics"]
        assert steps and steps == list(range(len(steps)))  # each worker detached: logs flushed


def test_sigterm_to_stabkit_run_nproc_stops_every_rank(tmp_path: Path, stabkit_cli: StabkitCLI) -> None:
    import psutil

    out = tmp_path / "np"
    proc = stabkit_cli.start(
        "run", "attention-logit-growth", "--steps", "3000", "--nproc", "2", "--out", str(out)
    )
    wait_until(logged(out / "baseline" / LOG_NAME))
    assert proc.poll() is None, proc.communicate()
    children = psutil.Process(proc.pid).children(recursive=True)  # torchrun and its ranks
    os.kill(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-3000:]
    _, alive = psutil.wait_procs(children, timeout=60)
    assert not alive, [p.cmdline() for p in alive]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["complete"] is False
    assert summary["variants"]["baseline"]["status"] == "interrupted"
    assert "PARTIAL: interrupted" in stdout
