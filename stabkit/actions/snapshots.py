"""In-memory snapshots of model and optimizer state for the `rollback` action (PaLM's recipe), and
their settings, `SnapshotOptions` (``DetectConfig.options["rollback"]``; the rescue action rolls back
through the same settings).

A snapshot is taken in the optimizer pre-step hook of every `snapshot_every`-th step whose checks
passed, so snapshot `t` is the state *before* update `t`. Restoring copies the saved values back
*in place* (same tensor objects: the user's optimizer, fused/foreach kernels and any references
keep working) and makes the restored state bitwise equal to the snapshot. Learning-rate schedules
and param-group settings are not rewound: rolled-back batches are skipped, not re-done.
Memory: `snapshots` × (parameters + buffers + optimizer state).
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..detect_config import DetectConfig
from ..stats.finite import nonfinite_flag
from ..tables import bounds


@dataclass(frozen=True)
class SnapshotOptions:
    """``DetectConfig.options["rollback"]``: the snapshots of rollback (and rescue)."""

    snapshot_every: int = field(default=100, metadata=bounds(lo=1))
    """Take an in-memory snapshot of model and optimizer state every N steps (PaLM restarted ~100 steps back)."""
    snapshots: int = field(default=2, metadata=bounds(lo=1))
    """Keep the K newest snapshots (memory: K × (model + optimizer state))."""
    snapshot_device: str | None = None
    """Where snapshots live (None = beside each tensor; 'cpu' saves accelerator memory at a copy cost)."""

    def __post_init__(self) -> None:
        if self.snapshot_device is not None:
            _check_device(self.snapshot_device)


@dataclass
class Snapshot:
    """Saved state before the update of `step`."""

    step: int
    model: list[torch.Tensor]
    """Copies of the model's parameters and buffers (each distinct tensor once), in `_tensors` order."""
    optimizer: dict[int, dict[str, tuple[Any, torch.device | None]]]
    """Parameter index -> {key: (copy, original device)} of its optimizer state (absent: no state yet)."""


class SnapshotStore:
    """Keeps the `keep` newest snapshots of `model` and `optimizer`."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        every: int,
        keep: int,
        device: str | None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.every = every
        self.device = torch.device(device) if device is not None else None
        self.snapshots: deque[Snapshot] = deque(maxlen=keep)
        self.params = (
            list(dict.fromkeys(p for g in optimizer.param_groups for p in g["params"])) if optimizer else []
        )

    @classmethod
    def for_config(cls, model: nn.Module, optimizer: Any, config: DetectConfig) -> SnapshotStore:
        """The store ``DetectConfig.options["rollback"]`` asks for (rollback, rescue)."""
        o = config.options_for("rollback", SnapshotOptions)
        return cls(model, optimizer, o.snapshot_every, o.snapshots, o.snapshot_device)

    def _tensors(self) -> list[torch.Tensor]:
        seen: dict[int, torch.Tensor] = {}
        for t in [*self.model.parameters(), *self.model.buffers()]:
            seen.setdefault(id(t), t)
        return list(seen.values())

    def _copy(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().to(self.device or value.device, copy=True)
        return copy.deepcopy(value)

    def due(self, step: int) -> bool:
        """True when a snapshot should be taken before the update of `step`."""
        return step % self.every == 0 and (not self.snapshots or self.snapshots[-1].step != step)

    @torch.no_grad()
    def take(self, step: int) -> Snapshot | None:
        """Copy the current state (call before the update of `step`); None, and nothing kept, when
        it holds NaN/Inf (a broken state is no place to roll back to)."""
        model = [self._copy(t) for t in self._tensors()]
        opt: dict[int, dict[str, tuple[Any, torch.device | None]]] = {}
        if self.optimizer is not None:
            for i, p in enumerate(self.params):
                state = self.optimizer.state.get(p)
                if state:
                    opt[i] = {k: (self._copy(v), getattr(v, "device", None)) for k, v in state.items()}
        copies = model + [v for st in opt.values() for v, _ in st.values() if isinstance(v, torch.Tensor)]
        bad = nonfinite_flag(copies)
        if bad is not None and bool(bad):  # sync point (once per snapshot)
            return None
        snap = Snapshot(step, model, opt)
        self.snapshots.append(snap)
        return snap

    def newest_before(self, step: int) -> Snapshot | None:
        """The newest snapshot taken at or before `step` (its state precedes update `step`)."""
        for snap in reversed(self.snapshots):
            if snap.step <= step:
                return snap
        return None

    @torch.no_grad()
    def restore(self, snap: Snapshot) -> None:
        """Write `snap` back in place; snapshots newer than it are dropped."""
        for t, saved in zip(self._tensors(), snap.model, strict=True):
            t.copy_(saved)
        if self.optimizer is not None:
            for i, p in enumerate(self.params):
                saved_state = snap.optimizer.get(i)
                if saved_state is None:
                    self.optimizer.state.pop(p, None)
                    continue
                state = self.optimizer.state[p]
                for key in [k for k in state if k not in saved_state]:
                    del state[key]
                for key, (value, device) in saved_state.items():
                    current = state.get(key)
                    if (
                        isinstance(value, torch.Tensor)
                        and isinstance(current, torch.Tensor)
                        and (current.shape == value.shape and current.dtype == value.dtype)
                    ):
                        current.copy_(value)
                    elif isinstance(value, torch.Tensor):
                        state[key] = value.to(device or value.device, copy=True)
                    else:
                        state[key] = copy.deepcopy(value)
        while self.snapshots and self.snapshots[-1].step > snap.step:
            self.snapshots.pop()


def _check_device(name: object) -> None:
    """Raise ValueError unless `name` names a device torch knows of and has here ('cpu', 'cuda:1', ...)."""
    try:
        device = torch.device(name)  # type: ignore[call-overload]
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"SnapshotOptions.snapshot_device must be None or a torch device such as 'cpu' or 'cuda:0', got {name!r}"
        ) from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"SnapshotOptions.snapshot_device={name!r}, but CUDA is not available here")
    if device.type not in ("cpu", "cuda", "mps", "xpu"):
        raise ValueError(
            f"SnapshotOptions.snapshot_device={name!r}: snapshots can live on cpu, cuda, mps or xpu devices"
        )
