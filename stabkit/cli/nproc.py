"""`stabkit run RECIPE --nproc N`: each variant trains with DDP on N local processes.

`relaunch` runs in the process the user started: it starts ``torchrun --standalone
--nproc_per_node N -m stabkit run ...`` (the same command without ``--nproc``) and turns the
summary into the exit code. `run_as_rank` runs in each rank (also under a torchrun the user
started): it joins the process group and runs the variants one after another, each on all ranks;
rank 0 alone shows progress, prints the table and writes the logs and summary.json.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from pathlib import Path

import click
import torch

from ..harness.recipes.signals import SigtermStop
from .app import UserInputError
from .progress import MultiProgress
from .run_cmd import exit_code, header, print_results

RELAUNCHED = "STABKIT_RUN_NPROC_PARENT"
"""Set by `stabkit run --nproc N` in the environment of the ranks it starts: rank 0 then exits 0
after writing summary.json, and the parent turns the summary into the exit code (so a partial run
does not make torchrun print a child-failure report)."""
STOP_FILE = "STABKIT_RUN_STOP_FILE"
"""Path the parent of the ranks creates on Ctrl-C; the ranks check it after each step."""


def run_as_rank(recipe: object, device: str, out_dir: Path, original: int | None) -> int:
    """One rank of a data-parallel run (under torchrun); returns the exit code.

    Joins the process group (gloo on CPU, NCCL on cuda:LOCAL_RANK), runs every variant with DDP on
    all ranks, and destroys the group at the end. A stop request (SIGINT from the terminal or from
    torchrun, or the stop file of `relaunch`) is agreed by the ranks at the next step, so the logs
    flush and the summary says it is partial.
    """
    import torch.distributed as dist

    from ..distributed import init_from_env
    from ..harness.recipes import Recipe, run_recipe

    assert isinstance(recipe, Recipe)
    if device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    else:
        torch.set_num_threads(1)
    ctx = init_from_env(device)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop_file = os.environ.get(STOP_FILE)

    def should_stop() -> bool:
        return stop.is_set() or (stop_file is not None and os.path.exists(stop_file))

    try:
        if not ctx.active:
            raise UserInputError("torchrun started several processes but STABKIT_DISTRIBUTED is off")
        bars = MultiProgress([v.name for v in recipe.variants], recipe.train.steps) if ctx.writes else None
        if ctx.writes:
            click.echo(header(recipe, device, 1, original, ddp=ctx.world_size))
        try:
            summary = run_recipe(
                recipe,
                out_dir,
                device=device,
                dist=ctx,
                on_progress=bars.update if bars else None,
                should_stop=should_stop,
            )
        finally:
            if bars is not None:
                bars.close()
        if ctx.writes:
            print_results(summary, out_dir)
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0 if os.environ.get(RELAUNCHED) else exit_code(summary)


def relaunch(nproc: int, args: list[str], out_dir: Path) -> int:
    """Run `stabkit ARGS` on `nproc` processes under torchrun and wait; returns the exit code.

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
        summary = json.loads((out_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        summary = None
    if interrupted:
        return 143 if term.hit else 130
    if code != 0 or summary is None:
        return code or 1
    return exit_code(summary)
