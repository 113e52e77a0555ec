"""`Recorder`: keeps each step's statistics as device tensors and copies them to the host once
per log interval.

`add` runs inside hooks (forward, backward, optimizer): it only does tensor arithmetic on the
device. `commit` runs at `Monitor.step`. `drain` runs once per log interval and is the single
host copy (one `.cpu()` per device).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

Combine = Literal["max", "min", "sum", "mean", "rms", "last"]
"""How values recorded several times within one step (micro-batches) combine."""
Reduction = Literal["mean", "sum", "max", "min", "l2", "rms"]
"""How a metric combines across ranks (declared per metric; used by distributed support)."""
Reducer = Callable[[torch.Tensor, list[Reduction]], torch.Tensor]
"""Combines a stacked 1-d tensor of values across ranks, each entry by its declared Reduction."""


@dataclass
class _Slot:
    value: torch.Tensor
    count: int
    combine: Combine


class Recorder:
    """Per-step device statistics, committed per step and drained to the host per log interval."""

    def __init__(self, reducer: Reducer | None = None) -> None:
        self.reducer = reducer
        """Called by `drain` on each device's stacked values before the host copy (cross-rank reduce)."""
        self._current: dict[str, _Slot] = {}
        self._pending: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.reductions: dict[str, Reduction] = {}
        """Cross-rank reduction declared by each metric name seen so far."""

    def add(
        self, name: str, value: torch.Tensor, combine: Combine = "last", reduction: Reduction = "mean"
    ) -> None:
        """Record a 0-d statistic for the current step (called from hooks; no host sync)."""
        value = value.detach().reshape(()).float()
        self.reductions.setdefault(name, reduction)
        slot = self._current.get(name)
        if slot is None or combine == "last":
            stored = value * value if combine == "rms" else value
            self._current[name] = _Slot(stored, 1, combine)
            return
        if combine == "max":
            slot.value = torch.maximum(slot.value, value)
        elif combine == "min":
            slot.value = torch.minimum(slot.value, value)
        elif combine == "rms":
            slot.value = slot.value + value * value
        else:  # sum, mean
            slot.value = slot.value + value
        slot.count += 1

    def has(self, name: str) -> bool:
        """True when `name` was recorded in the current step."""
        return name in self._current

    def current(self, name: str) -> torch.Tensor | None:
        """The current step's combined value of `name` (device tensor), if recorded."""
        slot = self._current.get(name)
        return None if slot is None else _finish(slot)

    def commit(self, step: int) -> dict[str, torch.Tensor]:
        """Close the current step: its statistics join the pending interval. Returns them (device)."""
        values = {name: _finish(slot) for name, slot in self._current.items()}
        self._current = {}
        if values:
            self._pending.append((step, values))
        return values

    def discard_current(self) -> None:
        """Forget what was recorded in the current step (e.g. a replayed step)."""
        self._current = {}

    @property
    def pending_steps(self) -> int:
        """Committed steps not yet copied to the host."""
        return len(self._pending)

    def drain(self) -> list[tuple[int, dict[str, float]]]:
        """Copy every pending step to the host in one transfer per device; returns (step, values) pairs."""
        if not self._pending:
            return []
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        names: dict[torch.device, list[str]] = {}
        for _, values in self._pending:
            for name, t in values.items():
                by_device.setdefault(t.device, []).append(t)
                names.setdefault(t.device, []).append(name)
        host: dict[torch.device, list[float]] = {}
        for dev, ts in by_device.items():
            stacked = torch.stack(ts)
            if self.reducer is not None:
                stacked = self.reducer(stacked, [self.reductions.get(n, "mean") for n in names[dev]])
            host[dev] = stacked.cpu().tolist()  # sync point: the one host copy per log interval
        cursor = dict.fromkeys(host, 0)
        out: list[tuple[int, dict[str, float]]] = []
        for step, values in self._pending:
            row: dict[str, float] = {}
            for name, t in values.items():
                row[name] = host[t.device][cursor[t.device]]
                cursor[t.device] += 1
            out.append((step, row))
        self._pending = []
        return out


def _finish(slot: _Slot) -> torch.Tensor:
    if slot.combine == "mean":
        return slot.value / slot.count
    if slot.combine == "rms":
        return torch.sqrt(slot.value / slot.count)
    return slot.value


def is_finite_number(x: float) -> bool:
    """True for a finite float (host-side helper for sinks and detectors)."""
    return math.isfinite(x)
