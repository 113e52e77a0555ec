"""Start-up helpers for scripts run under `torchrun` (and for `stabkit run --nproc`).

`init_from_env` runs once at the start of each rank; `shard_rows` picks this rank's rows of a
global batch; `torchrun_command` builds the command line that relaunches a stabkit CLI command
on N local processes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from .context import SINGLE, DistContext, process_group_active


def launched_by_torchrun() -> bool:
    """True when torchrun (or another launcher) set WORLD_SIZE > 1 for this process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_from_env(device: str = "cpu", timeout_s: float = 600.0) -> DistContext:
    """Join the job torchrun started: NCCL on CUDA (device cuda:LOCAL_RANK), gloo on the CPU.

    Does nothing when the process group already exists or when not launched with WORLD_SIZE > 1.
    Returns the resulting DistContext (rank, world size; `sharded` is for attach to decide).
    """
    if launched_by_torchrun() and not (dist.is_available() and dist.is_initialized()):
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    if not process_group_active():
        return SINGLE
    return DistContext(True, dist.get_rank(), dist.get_world_size())


def shard_rows(batch_size: int, ctx: DistContext) -> slice:
    """This rank's contiguous rows of a global batch of `batch_size` rows (equal shares required)."""
    if not ctx.active:
        return slice(0, batch_size)
    if batch_size % ctx.world_size:
        raise ValueError(
            f"a global batch of {batch_size} rows does not split evenly over {ctx.world_size} ranks; "
            "use a batch size divisible by the number of processes"
        )
    share = batch_size // ctx.world_size
    return slice(ctx.rank * share, (ctx.rank + 1) * share)


def torchrun_command(nproc: int, args: Sequence[str]) -> list[str]:
    """`python -m torch.distributed.run --standalone --nproc_per_node N -m stabkit ARGS...`.

    `--standalone` picks a free rendezvous port on this machine. `args` is the stabkit command
    line without its `--nproc` option (each rank then sees WORLD_SIZE and runs one share).
    """
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "stabkit",
        *args,
    ]
