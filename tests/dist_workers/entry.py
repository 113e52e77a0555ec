"""The entry point of a worker script that runs either in one process (the reference) or on each
torchrun rank: ``python <worker>.py SCENARIO OUT`` writes ``OUT/rank<r>.json`` (read back by
tests/distributed/launch.py)."""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch


def write(out: str, rank: int, world: int, result: dict[str, Any]) -> None:
    """This rank's result as ``OUT/rank<rank>.json``."""
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "world": world, **result}, fh, default=str)


def worker_main(run: Callable[[str, str], dict[str, Any]], single: Callable[[str], bool]) -> None:
    """Run ``run(scenario, out)`` here when ``single(scenario)``, else on this torchrun rank (gloo on
    CPU processes; a hang dumps the stacks after ``STABKIT_TEST_HANG_S`` seconds and exits)."""
    scenario, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    torch.set_num_threads(1)
    if single(scenario):
        write(out, 0, 1, run(scenario, out))
        return
    faulthandler.dump_traceback_later(float(os.environ.get("STABKIT_TEST_HANG_S", "150")), exit=True)
    from stabkit.distributed import init_from_env

    ctx = init_from_env("cpu")
    write(out, ctx.rank, ctx.world_size, run(scenario, out))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # Everything is written; leave without the interpreter's teardown, where a gloo/DTensor run has
    # aborted once in a while ("terminate called without an active exception", exit -6) after
    # finishing its work (seen in CI on the TP test, not reproducible at will).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
