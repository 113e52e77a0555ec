"""`tensor_stats` in two halves: the reductions that read a tensor (in the hook that sees it) and the
arithmetic that turns them into statistics, for many tensors at once (deferred to the end of the
step's reads, `Recorder.defer`).

`reduce_tensor` runs inside a forward hook (eager, any step the probe samples); `finish_tensors` runs
once per step for every tensor the hooks reduced, as a handful of vector ops per device. The numbers
are those of `tensor_stats`, bit for bit: the same reductions, the same divisions (``_foreach_div``
by each tensor's √numel, a host number), the same max. No host sync (on a CPU one host read per
tensor: its norm, to skip the non-finite count of a finite tensor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .reductions import CPU_ZERO, nonfinite_count, norm_f32


@dataclass(frozen=True)
class TensorReductions:
    """What a hook keeps of one tensor: 0-d device tensors and the element count."""

    norm: torch.Tensor
    """float32 L2 norm."""
    low: torch.Tensor
    """min (the tensor's dtype, float for integers)."""
    high: torch.Tensor
    """max."""
    nonfinite: torch.Tensor
    """float32 count of NaN/±Inf entries."""
    numel: int


def reduce_tensor(x: torch.Tensor) -> TensorReductions:
    """The reductions `tensor_stats` makes of `x` (two passes: norm, min/max; the non-finite count
    only when the norm is not finite on a CPU, always elsewhere). Eager only."""
    if torch.is_grad_enabled():  # hooks run under no_grad: no detach op there
        x = x.detach()
    if x.numel() == 0:
        zero = torch.zeros((), device=x.device)
        return TensorReductions(zero, zero, zero, zero, 0)
    if not x.is_floating_point():
        x = x.float()
    norm = norm_f32(x)
    low, high = torch.aminmax(x)
    # sync point: reads host memory only (CPU tensors), never a device; a NaN/±Inf makes the norm so
    if x.device.type == "cpu" and math.isfinite(float(norm)):
        return TensorReductions(norm, low, high, CPU_ZERO, x.numel())
    return TensorReductions(norm, low, high, nonfinite_count(x), x.numel())


def finish_tensors(kept: list[TensorReductions]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rms, abs-max, non-finite count) of the reductions `kept`, all on one device (`by_device`):
    three (k,) float32 vectors, in the order of `kept`. At least one."""
    roots = [math.sqrt(r.numel) if r.numel else 1.0 for r in kept]
    rms = torch.stack(torch._foreach_div([r.norm for r in kept], roots))
    low = torch.stack([r.low for r in kept]).float()  # mixed dtypes promote, then round as one by one
    high = torch.stack([r.high for r in kept]).float()
    counts = torch.stack([r.nonfinite for r in kept])  # on the device of the norms (`reduce_tensor`)
    return rms, torch.maximum(high, -low), counts


def by_device(kept: list[TensorReductions]) -> dict[torch.device, list[int]]:
    """Indices of `kept` per device (a model split across devices finishes one group per device)."""
    groups: dict[torch.device, list[int]] = {}
    for i, r in enumerate(kept):
        groups.setdefault(r.norm.device, []).append(i)
    return groups
