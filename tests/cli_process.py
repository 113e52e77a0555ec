"""The `stabkit` command in a fresh interpreter, as a user's shell runs it: for the tests that need a
process of their own (exit codes and stderr, Ctrl-C and SIGTERM, torchrun, full-length recipes).

Tests get a `StabkitCLI` from the ``stabkit_cli`` fixture (tests/conftest.py, which also marks every
test that uses it ``multiprocess``). The child runs from the repository root, with the checkout first
on ``PYTHONPATH`` (torchrun's ranks import the same stabkit) and one OpenMP thread per process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The repository root (the children's working directory)."""
TESTS = ROOT / "tests"

BOOT = "import sys; sys.argv[0] = 'stabkit'; from stabkit.cli import main; main()"
"""What the installed ``stabkit`` script runs (``python -c BOOT ARGS`` prints usage as ``stabkit``)."""


def interruptible() -> None:
    """`preexec_fn` of a child that a test interrupts: SIGINT back to its default (Python's
    KeyboardInterrupt). A shell without job control starts background jobs with SIGINT ignored and
    children inherit that (CI launched as ``bash .ci/run &``): without this, Ctrl-C tests would hang
    for reasons that have nothing to do with stabkit."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def child_env(*, tests: bool = False, **extra: str) -> dict[str, str]:
    """This process's environment for a child: the checkout (and with `tests`, tests/ for ``zoo``,
    ``standins`` ...) first on ``PYTHONPATH``, ``OMP_NUM_THREADS=1``, and `extra`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **extra}
    paths = [str(ROOT), *([str(TESTS)] if tests else []), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


class StabkitCLI:
    """Runs ``stabkit ARGS`` in a child process (see the module docstring)."""

    def __init__(self, timeout: float = 600.0) -> None:
        self.timeout = timeout

    @staticmethod
    def argv(*args: str) -> list[str]:
        return [sys.executable, "-c", BOOT, *args]

    def run(
        self, *args: str, timeout: float | None = None, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``stabkit ARGS`` to the end; its exit code, stdout and stderr (never raises on failure)."""
        return subprocess.run(
            self.argv(*args),
            capture_output=True,
            text=True,
            timeout=timeout or self.timeout,
            check=False,
            cwd=ROOT,
            env=env or child_env(),
        )

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """``stabkit ARGS`` started in the background (stdout and stderr piped)."""
        return subprocess.Popen(
            self.argv(*args),
            cwd=ROOT,
            env=env or child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=interruptible,
        )


def wait_until(ready: Callable[[], bool], timeout: float = 120.0, poll: float = 0.5) -> bool:
    """Poll `ready` until it is true (True) or `timeout` seconds have passed (False)."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def logged(*paths: Path, size: int = 2000) -> Callable[[], bool]:
    """A `wait_until` condition: every file in `paths` exists and holds more than `size` bytes (a
    run's ``stabkit.jsonl`` with a few steps in it)."""
    return lambda: all(p.is_file() and p.stat().st_size > size for p in paths)
