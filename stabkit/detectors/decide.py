"""`Decider`: when each detector runs, what it reads, and where the actions run.

Three moments of a step (see `DetectConfig` for the timing trade-off):
- `pre_update` (optimizer step pre-hook, before the update): the non-finite check (global grad
  norm, output flag, tracer) and the series detectors judge before the update (gradient norms) —
  only for kinds decided every step; one stacked host copy (`# sync point`). Then each action's
  periodic work (rollback snapshots) when nothing acted.
- `post_update` (optimizer step post-hook): the fused parameter / optimizer-state check (device).
- `on_step` (at `Monitor.step`, after commit): the update check and every other series of the kinds
  decided every step; one stacked host copy. Then the step's kept data is released.
- `on_rows` (at the log interval's host copy): every kind whose actions are all 'warn', from the
  host rows; extra series (spike scores) join the rows before the sinks write them.

The detectors themselves (`Judge`) see only names and floats; the non-finite device checks live in
`NonfiniteWatch`; the actions in `stabkit.actions.ActionRunner`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..actions import ActionRunner
from ..distributed import host_values
from ..events import Event
from .judge import Judge
from .watch import NonfiniteWatch, ScalerCheck


def _fetch(tensors: list[torch.Tensor], reductions: list[str]) -> list[float]:
    """Host values for a per-step decision, combined across ranks first (one collective when
    distributed), so every rank takes the same decision."""
    if not tensors:
        return []
    return host_values(tensors, reductions)  # sync point


class Decider:
    """Runs the detectors at the right moment and hands their events to the actions."""

    def __init__(
        self,
        judge: Judge,
        watch: NonfiniteWatch | None,
        actions: ActionRunner,
        recorder: Any,
        step: Callable[[], int],
        sampled_every: int,
        scaler_check: ScalerCheck | None = None,
    ) -> None:
        self.judge = judge
        self.watch = watch
        self.actions = actions
        self.recorder = recorder
        self.step = step
        self.scaler_check = scaler_check
        self.config = judge.ctx.config
        self.per_step = judge.kinds(per_step=True)
        """Kinds decided every step (an action other than warn)."""
        self.per_row = judge.kinds(per_step=False)
        """Kinds decided at the log interval, from the host rows."""
        self.nonfinite_per_step = watch is not None and self.config.needs_sync("nonfinite")
        every = self.config.optimizer_check_every
        if every is None:  # every step when a non-finite update must be acted on, else on sampled steps
            acting = any(a != "warn" for a in self.config.actions["nonfinite"])
            every = 1 if acting else sampled_every
        self.update_check_every = every
        self._series: dict[int, dict[str, float]] = {}
        self._pre_done = False
        self._acted = False
        self._judged_before: set[str] = set()

    # ------------------------------------------------------------------ before the update
    def pre_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Optimizer step pre-hook."""
        try:
            self._before_update(None)
        finally:
            if self.watch is not None:
                self.watch.guard.release_grads()

    def _before_update(self, committed: dict[str, torch.Tensor] | None) -> None:
        self._pre_done = True
        step = self.step()
        value = committed.get if committed is not None else self.recorder.current
        watch = self.watch
        flag = watch.flag(step, value, record=committed is None) if watch is not None else None
        early: list[str] = []
        if self.per_step:
            names = list(committed) if committed is not None else self.recorder.current_names()
            early = self.judge.wanted(names, self.per_step, before_update=True)
        self._judged_before = set(early)
        first = [flag] if self.nonfinite_per_step and flag is not None else []
        tensors = [t for n in early if (t := value(n)) is not None]
        reductions = self.recorder.reductions
        host = _fetch(first + tensors, ["max"] * len(first) + [reductions.get(n, "mean") for n in early])
        if first and watch is not None:
            if host.pop(0) > 0:
                self._act(watch.locate(step), before_update=True)
                return
            watch.open = False
        self._judge(step, dict(zip(early, host, strict=True)), before_update=True)
        if not self._acted:
            self.actions.before_update(step)

    # ------------------------------------------------------------------ after the update
    def post_update(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Optimizer step post-hook: fused NaN/Inf check of parameters and optimizer state (device)."""
        if self.watch is not None:
            self.watch.check_update(self.step(), self.update_check_every)

    def on_step(self, step: int, committed: dict[str, torch.Tensor]) -> None:
        """At `Monitor.step`: decisions after the update, then release what the step kept."""
        try:
            if not self._pre_done:
                self._before_update(committed)
            self._after_update(step, committed)
        finally:
            self._pre_done = self._acted = False
            self._judged_before = set()
            if self.watch is not None:
                self.watch.end_step()

    def _after_update(self, step: int, committed: dict[str, torch.Tensor]) -> None:
        watch = self.watch
        checks = watch.after_update_checks(committed) if watch is not None and self.nonfinite_per_step else []
        later: list[str] = []
        if self.per_step:
            later = [n for n in self.judge.wanted(committed, self.per_step) if n not in self._judged_before]
        reductions = self.recorder.reductions
        host = _fetch(
            [t for _, t in checks] + [committed[n] for n in later],
            ["max"] * len(checks) + [reductions.get(n, "mean") for n in later],
        )
        bad = [name for (name, _), v in zip(checks, host, strict=False) if v > 0]
        host = host[len(checks) :]
        if watch is not None and self.nonfinite_per_step:
            event = watch.after_update(step, bad)
            if event is not None:
                self._act(event, before_update=False)
        if self.scaler_check is not None and not (watch is not None and watch.now):
            event = self.scaler_check.event(step)
            if event is not None:
                if watch is not None:
                    watch.open = watch.now = True
                self._act(event, before_update=False)
        self._judge(step, dict(zip(later, host, strict=True)), before_update=False)

    # ------------------------------------------------------------------ at the log interval
    def on_rows(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        """Drain hook: warn-only kinds decide from the host rows; extra series join the rows."""
        watch = self.watch
        for step, row in rows:
            if watch is not None and not self.nonfinite_per_step:
                event = watch.row_event(step, row)
                if event is not None:
                    self._act(event, before_update=False)
            events, extra = self.judge.judge(step, row, self.per_row)
            for event in events:
                self._run(event, before_update=False)
            row.update(self._series.pop(step, {}))
            row.update(extra)
        if rows:
            last = rows[-1][0]
            self._series = {s: v for s, v in self._series.items() if s > last}
            if watch is not None:
                watch.forget_before(last)

    # ------------------------------------------------------------------ shared
    def _judge(self, step: int, values: dict[str, float], before_update: bool) -> None:
        if not values:
            return
        events, extra = self.judge.judge(step, values, self.per_step)
        if extra:
            self._series.setdefault(step, {}).update(extra)
        for event in events:
            self._run(event, before_update)

    def _act(self, event: Event, before_update: bool) -> None:
        """An event from the non-finite watch: advise it, then act."""
        self._run(self.judge.advise(event), before_update)

    def _run(self, event: Event, before_update: bool) -> None:
        self._acted = True
        self.judge.note(event)
        self.actions.run(event, before_update)
