"""`DetectorSet`: the detectors, the non-finite watch and the actions of one Monitor, wired together.

The Monitor builds it at attach (`DetectorSet(Wiring(...), config)`) after its probes, and registers
its hooks through the Monitor's `HookSet` (owner 'detectors'):
- on the root model: the `StepGuard`'s forward pre-hook and forward hook (inputs + RNG kept, output
  checked); with `per_module`, a `FiniteTracer` on every module;
- on the optimizer: a step pre-hook (after the gradient probe's, so `grad/global_norm` of the step
  is recorded) and a step post-hook (the parameter / optimizer-state check).
The Monitor then calls `on_step` at `Monitor.step` after the commit, and `on_rows` with each host
copy before the sinks write it. `remove()` takes every hook away (safe twice).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..actions import ActionContext, ActionRunner
from ..actions.rollback import Rollback
from ..actions.snapshots import SnapshotStore
from ..detect_config import DetectConfig
from ..discovery import ModelMap
from ..events import Event
from ..hooks import HookSet
from ..stats import Recorder
from .base import DetectorContext
from .decide import Decider
from .judge import Judge
from .watch import NonfiniteWatch, ScalerCheck

OWNER = "detectors"


@dataclass
class Wiring:
    """What the detectors get from the Monitor (and nothing more)."""

    model: nn.Module
    optimizer: Any | None
    model_map: ModelMap
    recorder: Recorder
    hooks: HookSet
    step: Callable[[], int]
    """Completed `Monitor.step` calls so far."""
    report: Callable[[Event], None]
    """Record an event and write it to the sinks at once."""
    muted: Callable[[], contextlib.AbstractContextManager[Any]]
    """A context in which the probes' statistics go nowhere (a replay's forward)."""
    logdir: Callable[[], Path | None]
    metrics: Callable[[], dict[str, float]]
    device_type: str = "cpu"
    sampled_every: int = 10
    """`MonitorConfig.every`."""
    scaled: bool = False
    """An enabled fp16 GradScaler was given to attach."""
    overflowed: Callable[[], bool] = lambda: False
    """With a GradScaler: whether this step's update was skipped (read at `Monitor.step`)."""
    distributed: bool = False


class DetectorSet:
    """The detectors attached to one Monitor. A context manager; `remove()` is safe to call twice."""

    def __init__(self, wiring: Wiring, config: DetectConfig) -> None:
        if not isinstance(config, DetectConfig):
            raise TypeError(f"stabkit detectors need a DetectConfig, got {type(config).__name__}")
        config = config.resolved(wiring.device_type)
        self.config = config
        self.wiring = wiring
        self.judge = Judge(DetectorContext.from_model_map(wiring.model_map, config))
        self.watch = (
            NonfiniteWatch(
                wiring.model,
                wiring.optimizer,
                config,
                wiring.recorder,
                wiring.hooks,
                scaled=wiring.scaled,
                can_replay=not wiring.distributed,
                muted=wiring.muted,
            )
            if config.runs("nonfinite")
            else None
        )
        watch = self.watch
        self.actions = ActionRunner(
            ActionContext(
                wiring.model,
                wiring.optimizer,
                config,
                forwards=lambda: watch.guard.forwards if watch is not None else [],
                logdir=wiring.logdir,
                metrics=wiring.metrics,
                report=wiring.report,
            ),
            wiring.report,
        )
        scaler_check = (
            ScalerCheck(wiring.model, wiring.optimizer, wiring.overflowed) if wiring.scaled else None
        )
        self.decider = Decider(
            self.judge,
            self.watch,
            self.actions,
            wiring.recorder,
            wiring.step,
            wiring.sampled_every,
            scaler_check,
        )
        if wiring.optimizer is not None:
            wiring.hooks.step_pre(OWNER, wiring.optimizer, self.decider.pre_update)
            wiring.hooks.step_post(OWNER, wiring.optimizer, self.decider.post_update)
        self.removed = False

    @property
    def snapshots(self) -> SnapshotStore | None:
        """The rollback action's snapshot store (None when no kind rolls back)."""
        action = self.actions.get("rollback")
        return action.snapshots if isinstance(action, Rollback) else None

    def on_step(self, step: int, committed: dict[str, torch.Tensor]) -> None:
        """At `Monitor.step`, after the step's statistics are committed."""
        self.decider.on_step(step, committed)

    def on_rows(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        """At each log interval, with the host rows, before the sinks write them (may add series)."""
        self.decider.on_rows(rows)

    def remove(self) -> None:
        """Remove every hook the detectors added (safe to call twice)."""
        if self.removed:
            return
        self.removed = True
        self.wiring.hooks.remove(OWNER)
        if self.watch is not None:
            self.watch.detach()

    detach = remove

    def state_dict(self) -> dict[str, Any]:
        """Detector state for a checkpoint (rolling windows, spike scores, drift windows...). Snapshots
        for rollback are in-memory only and not included."""
        state = self.judge.state_dict()
        state["nonfinite_open"] = self.watch.open if self.watch is not None else False
        state["actions"] = self.actions.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict()` returned."""
        self.judge.load_state_dict(state)
        self.actions.load_state_dict(state.get("actions", {}))
        if self.watch is not None:
            self.watch.open = bool(state.get("nonfinite_open", False))

    def __enter__(self) -> DetectorSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
