"""`Decisions`: the detectors, their device parts and the actions of one Monitor, run at the right
moment of each step. Beside `stabkit.monitor`, it is the one place that knows both the detectors
and the actions; the Monitor builds it at attach (`Decisions(Wiring(...), config)`), after its probes.

Hooks (through the Monitor's `HookSet`, owner 'detectors'; the device parts add their own, e.g. the
non-finite step guard on the root model and, with ``per_module``, a tracer on every module): an
optimizer step pre-hook (after the gradient probe's, so `grad/global_norm` of the step is recorded)
and a step post-hook. Four moments of a step (see `DetectConfig` for the timing trade-off):
- `pre_update` (step pre-hook, before the update): the device parts' flags (non-finite gradients,
  output, tracer) and the series judged before the update (gradient norms) of the kinds decided
  every step; one stacked host copy (`# sync point`). Then each action's periodic work (rollback
  snapshots) when nothing acted.
- `post_update` (step post-hook): the device parts' device work (the parameter / optimizer-state check).
- `on_step` (at `Monitor.step`, after commit): the device parts' flags of the step (update check,
  loss) and every other series of the kinds decided every step; one stacked host copy. Then the
  step's kept data is released.
- `on_rows` (at the log interval's host copy): the device parts' row checks and every kind whose
  actions are all 'warn', from the host rows; extra series (spike scores) join the rows before the
  sinks write them.

The detectors (`Judge`) see only names and floats; a kind that needs tensors has a device part
(`stabkit.detectors.device`, the extension point: built here from a narrow `DeviceContext`); the
actions are `stabkit.actions.ActionRunner`. `remove()` takes every hook away (safe twice).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .actions import ActionContext, ActionRunner
from .actions.snapshots import SnapshotStore
from .detect_config import DetectConfig
from .detectors import DetectorContext, DeviceChecks, DeviceContext, Judge
from .discovery import ModelMap
from .distributed import host_values
from .events import Event
from .hooks import HookSet
from .learning_rate import LR_SERIES, current_lr
from .stats import Recorder
from .stats.step_facts import StepFacts

OWNER = "detectors"


@dataclass(frozen=True)
class Wiring:
    """What the decisions get from the Monitor (and nothing more)."""

    model: nn.Module
    optimizer: Any | None
    model_map: ModelMap
    recorder: Recorder
    hooks: HookSet
    step: Callable[[], int]
    """Completed `Monitor.step` calls so far (the index of the step in progress)."""
    report: Callable[[Event], None]
    """Record an event and write it to the sinks at once."""
    muted: Callable[[], contextlib.AbstractContextManager[Any]]
    """A context in which the probes' statistics go nowhere (a replay's forward)."""
    logdir: Path | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    """The Monitor's newest logged host value of every metric (the live dict, read by actions)."""
    sampled_every: int = 10
    """`MonitorConfig.every`."""
    deep_every: int | None = None
    """`MonitorConfig.deep_cadence` (None: `sampled_every`)."""
    distributed: bool = False
    facts: StepFacts = field(default_factory=StepFacts)
    """What the step knows (the Monitor's `StepFacts`): the GradScaler, a skipped update, the
    after-update finiteness note."""
    warmup_steps: int | None = None
    """The run's LR warmup as `attach` was told it (None: not known)."""


def _fetch(tensors: list[torch.Tensor], reductions: list[str]) -> list[float]:
    """Host values for a per-step decision, combined across ranks first (one collective when
    distributed), so every rank takes the same decision."""
    if not tensors:
        return []
    return host_values(tensors, reductions)  # sync point


def _output_site(model_map: ModelMap) -> tuple[str, Callable[[Any], Any]] | None:
    """(path, take) of the module below the root that yields the final logits (`DeviceContext.output_site`)."""
    where = model_map.logits
    if where is None or not where.path:
        return None
    return where.path, where.take


class Decisions:
    """The detectors and actions attached to one Monitor. A context manager; `remove()` is safe twice."""

    def __init__(self, wiring: Wiring, config: DetectConfig) -> None:
        if not isinstance(config, DetectConfig):
            raise TypeError(f"stabkit detectors need a DetectConfig, got {type(config).__name__}")
        self.config = config
        self.wiring = wiring
        self.recorder = wiring.recorder
        self.judge = Judge(DetectorContext.from_model_map(wiring.model_map, config, wiring.warmup_steps))
        self.devices: dict[str, DeviceChecks] = {}
        """The device part of each running kind that has one (`Detector.device_checks`)."""
        for kind, detector in self.judge.detectors.items():
            part = detector.device_checks(self._device_context(kind))
            if part is not None:
                self.devices[kind] = part
        self.actions = ActionRunner(
            ActionContext(
                wiring.model,
                wiring.optimizer,
                config,
                forwards=lambda: [f for part in self.devices.values() for f in part.kept_forwards()],
                logdir=lambda: wiring.logdir,
                metrics=lambda: wiring.metrics,
                report=wiring.report,
                hooks=wiring.hooks,
                record=lambda name, value: wiring.recorder.add(name, value, reduction="max"),
                rewound=self.judge.rewind,
            ),
            wiring.report,
        )
        self.per_step = self.judge.kinds(per_step=True)
        """Kinds decided every step (an action other than warn)."""
        self.per_row = self.judge.kinds(per_step=False)
        """Kinds decided at the log interval, from the host rows."""
        self._series: dict[int, dict[str, float]] = {}
        self._lr: dict[int, float] = {}
        """The optimizer's learning rate per step not yet logged (`stabkit.learning_rate`)."""
        self._pre_done = False
        self._acted = False
        self._judged_before: set[str] = set()
        self._wanted_by_names: dict[tuple[tuple[str, ...], bool | None], list[str]] = {}
        """The per-step kinds' series among a step's names, per set of names (a sampled and an
        unsampled step each have theirs): worked out once, not every step."""
        if wiring.optimizer is not None:
            wiring.hooks.step_pre(OWNER, wiring.optimizer, self.pre_update)
            wiring.hooks.step_post(OWNER, wiring.optimizer, self.post_update)
        self.removed = False

    def _device_context(self, kind: str) -> DeviceContext:
        w = self.wiring

        def record(name: str, value: torch.Tensor, every: int | None = None) -> None:
            w.recorder.add(name, value, combine="max", reduction="max", every=every)

        return DeviceContext(
            w.model,
            w.optimizer,
            self.config,
            w.hooks,
            record,
            per_step=self.config.needs_sync(kind),
            sampled_every=w.sampled_every,
            deep_every=w.sampled_every if w.deep_every is None else w.deep_every,
            can_replay=not w.distributed,
            muted=w.muted,
            facts=w.facts,
            output_site=_output_site(w.model_map),
            step=w.step,
        )

    @property
    def snapshots(self) -> SnapshotStore | None:
        """The rollback action's snapshot store (None when no kind rolls back)."""
        action = self.actions.get("rollback")
        store = getattr(action, "snapshots", None)
        return store if isinstance(store, SnapshotStore) else None

    # ------------------------------------------------------------------ before the update
    def pre_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Optimizer step pre-hook."""
        try:
            self._before_update(None)
        finally:
            for part in self.devices.values():
                part.pre_update_done()

    def _before_update(self, committed: Mapping[str, torch.Tensor] | None) -> None:
        self._pre_done = True
        step = self.wiring.step()
        lr = current_lr(self.wiring.optimizer)
        if lr is not None:
            self._lr[step] = lr
        value = committed.get if committed is not None else self.recorder.current
        flags = [
            (part, flag)
            for part in self.devices.values()
            if (flag := part.before_update(step, value, committed is None)) is not None
        ]
        early: list[tuple[str, torch.Tensor]] = []
        if self.per_step:
            names = list(committed) if committed is not None else self.recorder.current_names()
            wanted = self._wanted(names, True)
            early = [(n, t) for n in wanted if (t := value(n)) is not None]
        self._judged_before = {n for n, _ in early}
        if flags or early:  # something to decide now (a warn-only step has nothing: no host copy)
            reductions = self.recorder.reductions
            host = _fetch(
                [f for _, f in flags] + [t for _, t in early],
                ["max"] * len(flags) + [reductions.get(n, "mean") for n, _ in early],
            )
            acted = False
            for (part, _), hit in zip(flags, host, strict=False):
                event = part.decide_before_update(step, hit > 0)
                if event is not None:
                    acted = self._act(event, part, before_update=True) or acted
            if acted:
                return
            self._judge(step, dict(zip([n for n, _ in early], host[len(flags) :], strict=True)), True)
        if not self._acted:
            self.actions.before_update(step)

    def _wanted(self, names: list[str], before_update: bool | None) -> list[str]:
        """`Judge.wanted` for the per-step kinds, remembered per (names, before_update)."""
        key = (tuple(names), before_update)
        hit = self._wanted_by_names.get(key)
        if hit is None:
            if len(self._wanted_by_names) >= 64:  # names that vary step to step: stay bounded
                self._wanted_by_names.clear()
            hit = self._wanted_by_names[key] = self.judge.wanted(names, self.per_step, before_update)
        return hit

    # ------------------------------------------------------------------ after the update
    def post_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Optimizer step post-hook: the device parts' device work (e.g. the parameter / optimizer-state check)."""
        step = self.wiring.step()
        for part in self.devices.values():
            part.after_update(step)

    def on_step(self, step: int, committed: Mapping[str, torch.Tensor]) -> None:
        """At `Monitor.step`, after the step's statistics are committed: decisions after the update,
        then release what the step kept."""
        try:
            if not self._pre_done:
                self._before_update(committed)
            self._after_update(step, committed)
        finally:
            self._pre_done = self._acted = False
            self._judged_before = set()
            for part in self.devices.values():
                part.end_step()

    def _after_update(self, step: int, committed: Mapping[str, torch.Tensor]) -> None:
        checks = [(part, name, t) for part in self.devices.values() for name, t in part.step_flags(committed)]
        later: list[str] = []
        if self.per_step:
            later = [n for n in self._wanted(list(committed), None) if n not in self._judged_before]
        reductions = self.recorder.reductions
        host = _fetch(
            [t for *_, t in checks] + [committed[n] for n in later],
            ["max"] * len(checks) + [reductions.get(n, "mean") for n in later],
        )
        for part in self.devices.values():
            flagged = [name for (p, name, _), v in zip(checks, host, strict=False) if p is part and v > 0]
            event = part.decide_step(step, flagged)
            if event is not None:
                self._act(event, part, before_update=False)
        self._judge(step, dict(zip(later, host[len(checks) :], strict=True)), False)

    # ------------------------------------------------------------------ at the log interval
    def on_rows(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        """At each log interval, with the host rows, before the sinks write them: warn-only kinds
        decide from the rows; extra series join the rows."""
        for step, row in rows:
            lr = self._lr.pop(step, None)
            if lr is not None:
                row[LR_SERIES] = lr
            for part in self.devices.values():
                event = part.decide_row(step, row)
                if event is not None:
                    self._act(event, part, before_update=False)
            events, extra = self.judge.judge(step, row, self.per_row)
            for event in events:
                self._run(event, before_update=False)
            row.update(self._series.pop(step, {}))
            row.update(extra)
        if rows:
            last = rows[-1][0]
            self._series = {s: v for s, v in self._series.items() if s > last}
            self._lr = {s: v for s, v in self._lr.items() if s > last}
            for part in self.devices.values():
                part.forget_before(last)

    # ------------------------------------------------------------------ shared
    def _judge(self, step: int, values: dict[str, float], before_update: bool) -> None:
        if not values:
            return
        lr = self._lr.get(step)
        if lr is not None:  # the rate-based rules read it beside the step's values
            values = {LR_SERIES: lr, **values}
        events, extra = self.judge.judge(step, values, self.per_step)
        if extra:
            self._series.setdefault(step, {}).update(extra)
        for event in events:
            self._run(event, before_update)

    def _act(self, event: Event, source: DeviceChecks, before_update: bool) -> bool:
        """An event from a device part: dropped when its kind was already decided at this step, else
        advised, acted on, and told to the other parts of its kind. True when it was acted on."""
        if self.judge.reported(event.step, event.kind):
            return False
        self._run(self.judge.advise(event), before_update)
        for part in self.devices.values():
            if part is not source and part.kind == event.kind:
                part.noted(event)
        return True

    def _run(self, event: Event, before_update: bool) -> None:
        self._acted = True
        self.judge.note(event)
        self.actions.run(event, before_update)

    # ------------------------------------------------------------------ lifetime and state
    def remove(self) -> None:
        """Remove every hook the detectors, their device parts and the actions added (safe twice)."""
        if self.removed:
            return
        self.removed = True
        self.wiring.hooks.remove(OWNER)
        for name in self.actions.actions:  # hooks an action kept (ActionContext.hooks, under its name)
            self.wiring.hooks.remove(name)
        for part in self.devices.values():
            part.detach()

    detach = remove

    def state_dict(self) -> dict[str, Any]:
        """Detector state for a checkpoint (rolling windows, spike scores, drift windows, device parts,
        actions). Snapshots for rollback are in-memory only and not included."""
        state = self.judge.state_dict()
        state["devices"] = {kind: s for kind, part in self.devices.items() if (s := part.state_dict())}
        state["actions"] = self.actions.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict()` returned."""
        self.judge.load_state_dict(state)
        self.actions.load_state_dict(state.get("actions", {}))
        devices = dict(state.get("devices", {}))
        for kind, part in self.devices.items():
            if kind in devices:
                part.load_state_dict(devices[kind])

    def __enter__(self) -> Decisions:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
