"""The one place that asks "does this hold NaN/Inf?": on the device (a 0-d flag, no host sync) or
on the host (a bool, one sync, used only once something was already found).

Used by the non-finite checks (gradients, parameters and optimizer state after an update), the
per-module tracer, replay, rollback snapshots and the GradScaler check. Runs wherever they run.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..distributed.context import local


def floating_tensors(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    """The non-empty floating-point tensors inside `obj` (tensor, tuple/list, dict/ModelOutput), two
    levels deep."""
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.is_floating_point() and obj.numel() > 0 else []
    if depth > 2:
        return []
    if isinstance(obj, tuple | list):
        return [t for item in obj for t in floating_tensors(item, depth + 1)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in floating_tensors(item, depth + 1)]
    return []


def nonfinite_flag(tensors: Iterable[torch.Tensor], *, ignore_neginf: bool = False) -> torch.Tensor | None:
    """0-d bool device tensor: some floating tensor holds NaN or ±Inf (None when there is none). No
    host sync.

    `ignore_neginf`: −Inf does not count (additive attention masks hold it): the max of each
    tensor is checked for NaN/+Inf. Otherwise on CUDA one fused max-norm per (device, dtype) group
    (`torch._foreach_norm(ord=inf)`: exact); elsewhere a float32 sum per tensor (NaN and ±Inf
    propagate; the CPU max-norm kernel is ~15× slower): only values near 1e32 could overflow a
    finite tensor's sum into a false alarm. FSDP2 DTensors are read through this rank's shard.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        t = local(t)  # FSDP2 DTensor: this rank's shard
        if t.is_floating_point() and t.numel() > 0:
            groups.setdefault((t.device, t.dtype), []).append(t)
    flags = []
    with torch.no_grad():
        for (device, _), group in groups.items():
            scalars = [t for t in group if t.dim() == 0]  # e.g. Adam's step counts: read at once
            group = [t for t in group if t.dim()]
            if ignore_neginf:
                top = [t.amax().float() for t in group]  # NaN if any NaN, +Inf if any +Inf
                if scalars:
                    top.append(torch.stack(scalars).amax().float())
                maxima = torch.stack(top)
                flags.append((torch.isnan(maxima) | torch.isposinf(maxima)).any())
                continue
            if device.type == "cuda":
                reduced = list(torch._foreach_norm(group, float("inf"))) if group else []
            else:
                reduced = [t.sum(dtype=torch.float32) for t in group]
            if scalars:
                reduced.append(torch.stack(scalars).sum(dtype=torch.float32))
            flags.append(~torch.isfinite(torch.stack(reduced)).all())
    return any_flag(flags)


def any_flag(flags: list[torch.Tensor]) -> torch.Tensor | None:
    """0-d bool: one of the 0-d device `flags` is set, on the first one's device (None for none). No
    host sync."""
    if not flags:
        return None
    first = flags[0].device
    if len(flags) <= 2 and all(f.dtype == torch.bool and f.dim() == 0 and f.device == first for f in flags):
        # this runs every step: one flag is its own "any", two are one `|` (not a stack and an any)
        return flags[0] if len(flags) == 1 else flags[0] | flags[1]
    return torch.stack([f.to(first) for f in flags]).any()


def nonfinite_scalar(value: torch.Tensor) -> torch.Tensor:
    """0-d bool: the 0-d floating `value` is NaN or ±Inf. ``value * 0`` is NaN exactly then: two ops,
    where ``~isfinite`` is five on a CPU (==, abs, !=, &, ~). Every step (the loss, the gradient norm),
    no host sync."""
    return (value * 0).isnan()


def any_nonfinite(values: list[torch.Tensor]) -> torch.Tensor:
    """0-d bool: one of the 0-d `values` (one device; e.g. norms, which a NaN/±Inf entry makes
    non-finite) is NaN or ±Inf. No host sync."""
    return ~torch.isfinite(torch.stack(values)).all()


def is_nonfinite(tensor: torch.Tensor) -> bool:
    """Host answer for one tensor (exact: `isfinite`). Syncs: call it only after a flag fired."""
    t = local(tensor)
    return t.is_floating_point() and not bool(torch.isfinite(t.detach()).all())  # sync point (on a hit only)
