"""`Recorder`: keeps each step's statistics as device tensors and copies them to the host once
per log interval.

`add` runs inside hooks (forward, backward, optimizer): it only does tensor arithmetic on the
device. `commit` runs at `Monitor.step`. `drain` runs once per log interval and is the single
host copy (one `.cpu()` per device).
"""

from __future__ import annotations

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
        self._pending: list[tuple[int, list[tuple[tuple[str, ...], torch.Tensor]]]] = []
        self._names: dict[tuple[str, ...], tuple[str, ...]] = {}
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

    def current(self, name: str) -> torch.Tensor | None:
        """The current step's combined value of `name` (device tensor), if recorded."""
        slot = self._current.get(name)
        return None if slot is None else _finish(slot)

    def current_names(self) -> list[str]:
        """Names recorded so far in the current step, in the order first recorded."""
        return list(self._current)

    def commit(self, step: int) -> dict[str, torch.Tensor]:
        """Close the current step: its statistics join the pending interval, packed into one 1-d
        tensor per device (one object per step instead of hundreds of 0-d tensors, which cost memory
        between log intervals). Returns the step's values as 0-d device tensors (for the detectors)."""
        values = {name: _finish(slot) for name, slot in self._current.items()}
        self._current = {}
        if values:
            by_device: dict[torch.device, list[str]] = {}
            for name, t in values.items():
                by_device.setdefault(t.device, []).append(name)
            groups = []
            for names in by_device.values():
                key = tuple(names)
                key = self._names.setdefault(key, key)  # steps with the same metrics share one tuple
                groups.append((key, torch.stack([values[n] for n in key])))
            self._pending.append((step, groups))
        return values

    @property
    def pending_steps(self) -> int:
        """Committed steps not yet copied to the host."""
        return len(self._pending)

    def drain(self) -> list[tuple[int, dict[str, float]]]:
        """Copy every pending step to the host in one transfer per device; returns (step, values) pairs."""
        if not self._pending:
            return []
        packs: dict[torch.device, list[torch.Tensor]] = {}
        names: dict[torch.device, list[str]] = {}
        for _, groups in self._pending:
            for key, packed in groups:
                packs.setdefault(packed.device, []).append(packed)
                names.setdefault(packed.device, []).extend(key)
        host: dict[torch.device, list[float]] = {}
        for dev, parts in packs.items():
            flat = torch.cat(parts)
            if self.reducer is not None:
                flat = self.reducer(flat, [self.reductions.get(n, "mean") for n in names[dev]])
            host[dev] = to_host(flat)
        cursor = dict.fromkeys(host, 0)
        out: list[tuple[int, dict[str, float]]] = []
        for step, groups in self._pending:
            row: dict[str, float] = {}
            for key, packed in groups:
                start = cursor[packed.device]
                row.update(zip(key, host[packed.device][start : start + len(key)]))
                cursor[packed.device] = start + len(key)
            out.append((step, row))
        self._pending = []
        self._names = {}
        return out


def to_host(values: torch.Tensor) -> list[float]:
    """The one host copy of a log interval (per device)."""
    return values.cpu().tolist()  # sync point: once per log interval


def _finish(slot: _Slot) -> torch.Tensor:
    if slot.combine == "mean":
        return slot.value / slot.count
    if slot.combine == "rms":
        return torch.sqrt(slot.value / slot.count)
    return slot.value
