"""`install(monitor, config) -> DetectorHandle`: plugs the detectors and actions into a Monitor.

What it registers (all removed by `DetectorHandle.remove()`, safe twice):
- on the root model: `StepGuard`'s forward pre-hook and forward hook (inputs + RNG kept, output
  checked); with `per_module`, a `FiniteTracer` on every module;
- on the optimizer: a step pre-hook (registered after the GradProbe's, so `grad/global_norm` of
  the step is recorded) and a step post-hook (the parameter / optimizer-state check);
- `monitor.observers`: `Decider.on_step`, called at `Monitor.step` after the step is committed;
- `monitor.drain_hooks`: `Decider.on_rows`, called with the rows of each host copy before the
  sinks write them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch.utils.hooks import RemovableHandle

from .actions import Actor
from .config import DetectConfig
from .decide import Decider
from .drift import DriftDetector
from .nonfinite import StepGuard
from .snapshots import SnapshotStore
from .spike import SpikeDetector
from .tracer import FiniteTracer

if TYPE_CHECKING:
    from ..monitor import Monitor

STATE_VERSION = 1


class DetectorHandle:
    """The detectors attached to one Monitor. A context manager; `remove()` is safe to call twice."""

    def __init__(self, monitor: Monitor, config: DetectConfig) -> None:
        if not isinstance(config, DetectConfig):
            raise TypeError(f"stabkit detectors need a DetectConfig, got {type(config).__name__}")
        self.monitor = monitor
        config = config.resolved(monitor._device.type)
        self.config = config
        self.spikes = SpikeDetector(config)
        self.drifts = DriftDetector(config, monitor.model_map)
        model, optimizer = monitor.model, monitor.optimizer
        self.snapshots = (
            SnapshotStore(model, optimizer, config.snapshot_every, config.snapshots, config.snapshot_device)
            if config.wants_rollback
            else None
        )
        replayable = not getattr(getattr(monitor, "dist", None), "active", False)
        # the output gradient only serves a replay, and a replay only happens when non-finite values
        # are decided per step (warn-only decides at the log interval): keep it only then
        keep_grad = (
            config.keep_output_grad
            and config.loss_fn is None
            and config.localize
            and replayable
            and config.needs_sync("nonfinite")
        )
        self.guard = (
            StepGuard(model, self.record, config.check_output, keep_grad) if config.nonfinite else None
        )
        self.tracer = FiniteTracer(model) if config.per_module and config.nonfinite else None
        self.actor = Actor(monitor, config, self.snapshots, self.guard)
        self.decider = Decider(self)
        self._handles: list[RemovableHandle] = []
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self.decider.pre_update))
            self._handles.append(optimizer.register_step_post_hook(self.decider.post_update))
        monitor.observers.append(self.decider.on_step)
        monitor.drain_hooks.append(self.decider.on_rows)
        self.removed = False

    def record(self, name: str, value: Any) -> None:
        """Add a per-step flag (combined by max) to the monitor's recorder."""
        self.monitor.recorder.add(name, value, combine="max", reduction="max")

    def remove(self) -> None:
        """Remove every hook and observer the detectors added (safe to call twice)."""
        if self.removed:
            return
        self.removed = True
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.guard is not None:
            self.guard.detach()
        if self.tracer is not None:
            self.tracer.detach()
        mon = self.monitor
        if self.decider.on_step in mon.observers:
            mon.observers.remove(self.decider.on_step)
        if self.decider.on_rows in mon.drain_hooks:
            mon.drain_hooks.remove(self.decider.on_rows)

    detach = remove

    def state_dict(self) -> dict[str, Any]:
        """Detector state for a checkpoint (rolling windows, spike scores, drift windows). Snapshots
        for rollback are in-memory only and not included."""
        return {
            "version": STATE_VERSION,
            "spike": self.spikes.state_dict(),
            "drift": self.drifts.state_dict(),
            "nonfinite_open": self.decider.nonfinite_open,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict()` returned."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"detector state version {state.get('version')!r} is not {STATE_VERSION}; "
                "it was saved by another stabkit version"
            )
        self.spikes.load_state_dict(state["spike"])
        self.drifts.load_state_dict(state["drift"])
        self.decider.nonfinite_open = bool(state["nonfinite_open"])

    def __enter__(self) -> DetectorHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def install(monitor: Monitor, config: DetectConfig | None = None) -> DetectorHandle:
    """Attach detectors and actions to `monitor` (call after its probes are attached)."""
    return DetectorHandle(monitor, config or DetectConfig())
