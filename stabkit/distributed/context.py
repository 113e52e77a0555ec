"""Where this process sits in a `torch.distributed` job, read once at `attach`.

Three modes:
- single: torch.distributed is not initialised, or has one rank (or ``STABKIT_DISTRIBUTED=0``);
- replicated: every trainable parameter is a plain tensor; stabkit takes each rank to hold the
  same parameters, with gradients averaged during backward (DDP);
- sharded: some trainable parameter is a DTensor (FSDP2 ``fully_shard``, tensor parallel); each
  rank holds a piece of it.

Norms combine across ranks as √(Σ over ranks of local²). A parameter held identically by r ranks
enters each rank's sum as local²/r, so the sum counts it once: r = the world size for a plain
replicated parameter; for a DTensor, the product of the mesh sizes of its Replicate dimensions
times the ranks outside its mesh (world size / mesh size). The latter counts a DTensor on a sub-mesh
once: under FSDP2 × tensor parallel a parameter the TP plan left alone (a norm weight without
sequence parallel) is sharded on the data-parallel mesh only and held identically by every TP rank.
A DTensor gradient can come in another layout than its parameter (a Shard(0) embedding's gradient
is Replicate; a SequenceParallel norm weight's is Partial, a sum not yet taken): `like_param` lays
it out as the parameter first.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ENV_SWITCH = "STABKIT_DISTRIBUTED"
"""Set to 0 / off / false to make every process behave as a single-process run (no collectives)."""

try:  # DTensor needs a torch built with distributed support
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover - builds without torch.distributed

    class DTensor:  # type: ignore[no-redef]
        """Stand-in so isinstance checks are False."""

    Replicate = None  # type: ignore[assignment,misc]


def process_group_active() -> bool:
    """True when collectives are on: torch.distributed is initialised with more than one rank and
    not switched off by ``STABKIT_DISTRIBUTED=0``. Cheap; safe to call anywhere."""
    if not (dist.is_available() and dist.is_initialized()):  # the common case first: no environment read
        return False
    if os.environ.get(ENV_SWITCH, "").strip().lower() in ("0", "off", "false", "no"):
        return False
    return dist.get_world_size() > 1


def is_dtensor(t: Any) -> bool:
    """True for a DTensor (a sharded or replicated piece of a global tensor)."""
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of `t` this rank holds: `to_local()` of a DTensor (a view), else `t` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def replicas(t: torch.Tensor, world_size: int) -> int:
    """How many ranks hold an identical copy of this rank's piece of `t` (see the module notes)."""
    if isinstance(t, DTensor):
        mesh = t.device_mesh
        count = max(world_size // mesh.size(), 1)  # ranks outside a sub-mesh hold the same pieces
        for dim, placement in enumerate(t.placements):
            if placement.is_replicate():
                count *= mesh.size(dim)
        return count
    return world_size


def plain(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `t` as a plain tensor, with no sum left pending: a DTensor with a Partial
    placement (a tensor-parallel partial result) is first redistributed to Replicate there (a
    collective over its mesh: call on every rank in the same order); Shard and Replicate pieces are
    `to_local()` views (their cross-rank reduction combines them). Anything else is `t` itself."""
    if not isinstance(t, DTensor):
        return t
    if any(p.is_partial() for p in t.placements):
        replicate = Replicate()
        t = t.redistribute(t.device_mesh, [replicate if p.is_partial() else p for p in t.placements])
    return t.to_local()


def like_param(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`grad` in the layout of `param`: a DTensor gradient whose placements differ from its
    parameter's is redistributed (Replicate -> Shard is a local slice; a Partial gradient, as of a
    SequenceParallel norm weight, needs a collective over its mesh: call on every rank, in the same
    order). Anything else is returned unchanged."""
    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job (frozen at `attach`)."""

    active: bool
    """Collectives are on (initialised, more than one rank, not switched off)."""
    rank: int = 0
    world_size: int = 1
    sharded: bool = False
    """Some trainable parameter is a DTensor (FSDP2 / tensor parallel)."""

    @property
    def mode(self) -> str:
        """'single', 'replicated' (DDP) or 'sharded' (FSDP2)."""
        if not self.active:
            return "single"
        return "sharded" if self.sharded else "replicated"

    @property
    def writes(self) -> bool:
        """True on the rank that writes the sinks (rank 0, or every process when not distributed)."""
        return not self.active or self.rank == 0

    def norm_scales(self, params: Iterable[torch.Tensor]) -> list[float]:
        """Per parameter, the factor 1/√replicas that makes local norms combine by 'l2' into the
        norm of the whole tensor (all 1.0 when not distributed)."""
        if not self.active:
            return [1.0 for _ in params]
        return [1.0 / math.sqrt(replicas(p, self.world_size)) for p in params]


SINGLE = DistContext(active=False)


def detect(model: nn.Module) -> DistContext:
    """Read the process group and the parameters of `model` (the module stabkit hooks, unwrapped).
    Called once at `attach`."""
    if not process_group_active():
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not (dist.is_available() and dist.is_initialized()):
            warnings.warn(
                "stabkit: WORLD_SIZE > 1 but torch.distributed is not initialised yet, so every rank "
                "would write its own logs; call dist.init_process_group() before stabkit.attach",
                RuntimeWarning,
                stacklevel=3,
            )
        return SINGLE
    sharded = any(isinstance(p, DTensor) for p in model.parameters() if p.requires_grad)
    return DistContext(True, dist.get_rank(), dist.get_world_size(), sharded)


def unwrap_data_parallel(model: nn.Module) -> nn.Module:
    """The module inside a `DistributedDataParallel` (or `DataParallel`) wrapper, else `model`.

    stabkit hooks the inner module: its parameter and module names are the model's own, and
    forward hooks on it run inside the wrapper's forward. FSDP (v1) is not supported (its flat
    parameters hide the per-layer gradients): a warning says to use `fully_shard` (FSDP2).
    """
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while isinstance(model, DistributedDataParallel | DataParallel):
        model = model.module
    if type(model).__name__ == "FullyShardedDataParallel":
        warnings.warn(
            "stabkit: FSDP (v1) wrappers are not supported (flat parameters hide per-layer gradients); "
            "shard with torch.distributed.fsdp.fully_shard (FSDP2) to get exact per-layer norms",
            RuntimeWarning,
            stacklevel=3,
        )
    return model
