"""`stabkit run RECIPE --nproc N`: each variant trains with DDP on N local processes.

`relaunch` runs in the process the user started: it starts ``torchrun --standalone
--nproc_per_node N -m stabkit run ...`` (the same command without ``--nproc``), waits, and says
how it ended (`Relaunched`). `rank_group` and `rank_should_stop` run in each rank (also under a
torchrun the user started): join the process group, and agree on stopping when asked; the
variants then run one after another, each on all ranks (`run_recipe` with the rank's context).
The CLI shows progress and results on rank 0 and turns the outcome into an exit code.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..distributed import DistContext
from .recipes.results.summary import Summary
from .recipes.run.signals import SigtermStop

RELAUNCHED = "STABKIT_RUN_NPROC_PARENT"
"""Set by `stabkit run --nproc N` in the environment of the ranks it starts: rank 0 then exits 0
after writing summary.json, and the parent turns the summary into the exit code (so a partial run
does not make torchrun print a child-failure report)."""
STOP_FILE = "STABKIT_RUN_STOP_FILE"
"""Path the parent of the ranks creates on Ctrl-C; the ranks check it after each step."""


def relaunched() -> bool:
    """True in a rank started by `relaunch` (its parent reports the outcome)."""
    return bool(os.environ.get(RELAUNCHED))


def rank_device(device: str) -> str:
    """This rank's device: ``cuda:LOCAL_RANK`` for cuda; on the CPU one torch thread per rank."""
    if device == "cuda":
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    torch.set_num_threads(1)
    return device


@contextmanager
def rank_group(device: str) -> Iterator[DistContext]:
    """Join the process group of this torchrun rank (gloo on CPU, NCCL on cuda:LOCAL_RANK; `device`
    as `rank_device` gives it), and leave it at the end: every rank waits for the others (rank 0
    writing and printing) before the group is destroyed. ValueError when distributed is off."""
    import torch.distributed as dist

    from ..distributed import init_from_env

    ctx = init_from_env(device)
    try:
        if not ctx.active:
            raise ValueError("torchrun started several processes but STABKIT_DISTRIBUTED is off")
        yield ctx
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_should_stop() -> Callable[[], bool]:
    """A `should_stop` for this rank: SIGINT (from the terminal or from torchrun) or the stop file
    of `relaunch`. The ranks agree on it at the next step, so the logs flush and the summary says
    it is partial."""
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop_file = os.environ.get(STOP_FILE)

    def should_stop() -> bool:
        return stop.is_set() or (stop_file is not None and os.path.exists(stop_file))

    return should_stop


@dataclass
class Relaunched:
    """How a `relaunch` ended."""

    returncode: int
    """torchrun's exit code."""
    summary: Summary | None
    """``summary.json`` as rank 0 left it (None: not written or unreadable)."""
    stopped_by: str | None = None
    """"SIGINT" (Ctrl-C) or "SIGTERM" when this process was asked to stop, else None."""


def relaunch(nproc: int, args: list[str], out_dir: Path) -> Relaunched:
    """Run `stabkit ARGS` on `nproc` processes under torchrun and wait.

    torchrun (which starts each rank in a session of its own) runs in its own session too, so a
    Ctrl-C reaches this process only. The first one (or a SIGTERM) creates the stop file the ranks
    look for after each step (they stop together at the next one, logs flushed, summary partial); a
    second Ctrl-C ends torchrun (SIGTERM, passed on to the ranks).
    """
    from ..distributed import torchrun_command

    stop_file = Path(tempfile.mkdtemp(prefix="stabkit-run-")) / "stop"
    env = {**os.environ, RELAUNCHED: "1", STOP_FILE: str(stop_file)}
    env.setdefault("OMP_NUM_THREADS", "1")
    root = str(Path(__file__).resolve().parents[2])  # the ranks import this same stabkit
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    proc = subprocess.Popen(torchrun_command(nproc, args), env=env, start_new_session=True)
    interrupted = False
    try:
        with SigtermStop() as term:  # a SIGTERM here asks the ranks to stop, as the first Ctrl-C does
            while True:
                try:
                    code = proc.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    if term.hit and not interrupted:
                        stop_file.touch()
                        interrupted = True
                except KeyboardInterrupt:
                    if interrupted:
                        proc.terminate()
                    stop_file.touch()
                    interrupted = True
    finally:
        shutil.rmtree(stop_file.parent, ignore_errors=True)
    try:
        summary: Summary | None = Summary.from_dict(
            json.loads((out_dir / "summary.json").read_text(encoding="utf-8"))
        )
    except (OSError, ValueError, TypeError):
        summary = None
    stopped_by = ("SIGTERM" if term.hit else "SIGINT") if interrupted else None
    return Relaunched(code, summary, stopped_by)
