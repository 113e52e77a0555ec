"""`NonfiniteWatch`: the device part of the 'nonfinite' kind — the checks that need the model.

Built by `NonfiniteDetector.device_checks` at attach (the detectors' extension point,
`stabkit.detectors.device`: the methods below are its moments). What it owns and when each runs:
- `StepGuard` (root forward pre-/post-hooks, training forwards): keeps the step's inputs for a
  replay (every forward) and flags a non-finite model output (`NonfiniteOptions.output_check_every`:
  every step when decided per step, else on sampled steps); `FiniteTracer` with ``per_module``
  (every module);
- `before_update` (optimizer step pre-hook): one device flag from the global gradient norm (or the
  gradients themselves), the output flag and the tracer; decided now when the kind is decided
  every step, and then, on the steps the optimizer-state check runs, a negative Adam second moment
  too (`stabkit.nonfinite.moments`: the coming update would be NaN);
- `decide_before_update` (pre-hook, on a step decided non-finite): names the producer (tracer hit,
  a negative second moment, or a replay);
- `after_update` (optimizer step post-hook): the fused parameter / optimizer-state check;
- `step_flags` / `decide_step` (at `Monitor.step`, decided every step) and `decide_row` (at the log
  interval, warn only): the loss and the update check.

It returns events; the orchestration (`stabkit.decisions`) advises them and runs the actions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..detectors.device import DeviceChecks, DeviceContext, ValueOf
from ..distributed import first_across_ranks, process_group_active
from ..events import Event
from ..stats.finite import any_flag, nonfinite_flag, nonfinite_scalar
from .guard import OUTPUT_METRIC, UPDATE_METRIC, StepGuard, optimizer_tensors
from .localize import FaultSite, finding_event, locate_update_fault, replay
from .moments import find_negative, negative_event, negative_flag
from .options import NonfiniteOptions
from .tracer import FiniteTracer

GRAD_FLAG = "grad/nonfinite"
"""Recorded only when the grad probe is off: 1 when some gradient held NaN/Inf."""
Origin = tuple[torch.Tensor, torch.Tensor, list[tuple[str, str, str]]]


class NonfiniteWatch(DeviceChecks):
    """Device-side non-finite checks of one model (the device part of the 'nonfinite' kind)."""

    kind = "nonfinite"

    def __init__(self, ctx: DeviceContext, options: NonfiniteOptions) -> None:
        self.model = model = ctx.model
        self.optimizer: Any = ctx.optimizer
        self.facts = ctx.facts
        self.options = options
        self.record = ctx.record
        """Add a per-step flag (combined by max) to the step's statistics."""
        self.per_step = ctx.per_step
        """Decided every step (an action other than warn, or sync); else at the log interval."""
        self.scaled = ctx.scaled
        """An fp16 GradScaler is in use: non-finite gradients are expected and handled by it."""
        self.can_replay = ctx.can_replay
        """Replays re-run forward/backward on this rank alone, which a distributed job cannot do."""
        self.muted = ctx.muted
        every = options.optimizer_check_every
        if every is None:  # every step when a non-finite update must be acted on, else with the
            # whole-model statistics (`MonitorConfig.deep_every`)
            acting = any(a != "warn" for a in ctx.config.actions["nonfinite"])
            deep = ctx.sampled_every if ctx.deep_every is None else ctx.deep_every
            every = 1 if acting else deep
        self.update_check_every = every
        # the output gradient only serves a replay, and a replay only happens when non-finite values
        # are decided per step (warn-only decides at the log interval): keep it only then
        keep_grad = (
            options.keep_output_grad
            and options.loss_fn is None
            and options.localize
            and self.can_replay
            and self.per_step
        )
        # the step's inputs serve a replay (decided per step) and the actions that re-run or save
        # the step (dump, rescue); a warn-only run reads none of them
        acting = any(a != "warn" for acts in ctx.config.actions.values() for a in acts)
        self.guard = StepGuard(
            model,
            self.record,
            options.check_output,
            keep_grad,
            ctx.hooks,
            output_site=ctx.output_site,
            keep_inputs=self.per_step or acting,
            output_every=(
                options.output_check_every
                if options.output_check_every is not None
                else 1
                if self.per_step
                else ctx.sampled_every
            ),
            step=ctx.step,
        )
        self.tracer = FiniteTracer(model, hooks=ctx.hooks) if options.per_module else None
        self.open = False
        """A non-finite run of steps is in progress (replay and the unlocalized report happen once per run)."""
        self.now = False
        """This step was already reported non-finite."""
        self._update_bad: torch.Tensor | None = None
        self._negative: torch.Tensor | None = None
        """This step's device flag: some Adam second moment is negative (checked steps, per-step mode)."""
        self._other: torch.Tensor | None = None
        """This step's other pre-update flag (gradients, output, tracer): when set, the step is
        localized as before (a NaN gradient, not the negative moment, is what the update meets first)."""
        self._origins: dict[int, Origin] = {}

    # ------------------------------------------------------------------ before the update
    def before_update(self, step: int, value: ValueOf, record: bool) -> torch.Tensor | None:
        """The step's flag (tracer origins and the gradient flag are kept either way), to be decided
        now only when the kind is decided every step; then, every `update_check_every`-th step, with
        the negative-second-moment flag (`stabkit.nonfinite.moments.negative_flag`)."""
        if not self.per_step and self.tracer is None and value("grad/global_norm") is not None:
            return None  # decided at the log interval, from rows that hold the norm and the output flag
        flag = self.flag(step, value, record)
        if not self.per_step:
            return None
        every = self.update_check_every
        checked = self.optimizer is not None and every and not step % every
        self._negative = negative_flag(self.optimizer) if checked else None
        self._other = flag
        return any_flag([f for f in (flag, self._negative) if f is not None])

    def decide_before_update(self, step: int, flagged: bool) -> Event | None:
        """On a step decided non-finite: the event, with the producer when found."""
        if flagged:
            return self.locate(step)
        self.open = False
        return None

    def pre_update_done(self) -> None:
        """Drop the kept output gradients (any replay is over)."""
        self.guard.release_grads()

    def flag(self, step: int, value: ValueOf, record: bool) -> torch.Tensor | None:
        """0-d device flag: this step is non-finite so far (None when nothing could be checked)."""
        origin: Origin | None = None
        if self.tracer is not None:
            hit, index = self.tracer.first()
            origin = (hit, index, list(self.tracer.sites))
            self._origins[step] = origin
            self.tracer.reset()
        flags = []
        norm = value("grad/global_norm")
        if self.scaled:
            pass  # fp16 GradScaler: overflowed gradients are its business (reported as amp/overflow)
        elif norm is not None:
            flags.append(nonfinite_scalar(norm))
        else:
            grads = nonfinite_flag(p.grad for p in self.model.parameters() if p.grad is not None)
            if grads is not None:
                flags.append(grads)
                if record:
                    self.record(GRAD_FLAG, grads.float())
        if self.guard.output_bad is not None:
            flags.append(self.guard.output_bad)
        if origin is not None:
            flags.append(origin[0])
        return any_flag(flags)

    def locate(self, step: int) -> Event:
        """On a step decided non-finite before the update: the event, with the producer when found."""
        origin = self._origins.get(step)
        finding = self._origin_site(origin)
        if finding is None and self._negative is not None:
            negative = self._negative_moment(step)
            if negative is not None:
                return negative
        if finding is None and self.options.localize and self.can_replay and self.guard.forwards:
            finding = self._replay()  # starts with a cheap check for weights an earlier update broke
        repeat = self.open
        self.open = self.now = True
        event = finding_event(step, finding, "grad/global_norm", math.nan)
        if repeat:
            event.details["repeat"] = True
            event.message += " (the previous step was non-finite too)"
        return event

    def _negative_moment(self, step: int) -> Event | None:
        """The event naming a negative second moment when its flag is set (host reads, on a hit only;
        under torch.distributed the first such parameter any rank holds, the same on every rank)."""
        assert self._negative is not None
        other = self._other is not None and bool(self._other)  # sync point (on a hit only)
        hit = not other and bool(self._negative)  # sync point (on a hit only)
        found = find_negative(self.model, self.optimizer) if hit else None
        if process_group_active():  # every rank saw the combined flag: every rank gets here
            names = [n for n, _ in self.model.named_parameters()]
            order = names.index(found.param) if found is not None and found.param in names else len(names)
            found = first_across_ranks(found, order)
        if found is None:
            return None
        repeat = self.open
        self.open = self.now = True
        event = negative_event(step, found)
        if repeat:
            event.details["repeat"] = True
            event.message += " (the previous step was non-finite too)"
        return event

    def _replay(self) -> FaultSite:
        self.guard.paused = True
        try:
            with self.muted():  # the replay's statistics go nowhere
                return replay(self.model, self.guard.forwards, self.optimizer, self.options.loss_fn)
        finally:
            self.guard.paused = False
            if self.tracer is not None:
                self.tracer.reset()

    # ------------------------------------------------------------------ after the update
    def after_update(self, step: int) -> None:
        """Optimizer step post-hook: fused NaN/Inf check of parameters and optimizer state (device),
        every `update_check_every`-th step."""
        every = self.update_check_every
        if not every or step % every:
            return
        params = [p for p in self._parameters() if p.requires_grad]  # unfrozen ones too
        tensors = [*params, *optimizer_tensors(self.optimizer)]
        flags = []
        note = self.facts.take_after_update(step)  # what the update-norm pass read already
        if note is not None:
            tensors = [t for t in tensors if id(t) not in note.tensors]
            flags.append(note.flag)
        rest = nonfinite_flag(tensors)
        flag = any_flag(flags if rest is None else [*flags, rest])
        if flag is not None:
            self.record(UPDATE_METRIC, flag.float())
            self._update_bad = flag

    def _parameters(self) -> list[torch.Tensor]:
        """The model's parameters, listed at the first check and again when the optimizer's groups
        change (a parameter new to the model joins them): no walk of the model per checked step."""
        groups = [] if self.optimizer is None else [len(g["params"]) for g in self.optimizer.param_groups]
        listed = getattr(self, "_listed", None)
        if listed is None or listed[0] != groups:
            params: list[torch.Tensor] = list(self.model.parameters())
            listed = self._listed = (groups, params)
        return listed[1]

    def step_flags(self, committed: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """At `Monitor.step`, decided every step: (name, device flag) pairs to copy to the host with
        the step's values (the update check, the loss)."""
        checks: list[tuple[str, torch.Tensor]] = []
        if not self.per_step:
            return checks
        if self._update_bad is not None:
            checks.append((UPDATE_METRIC, self._update_bad))
        if "loss" in committed:
            checks.append(("loss", nonfinite_scalar(committed["loss"])))
        return checks

    def decide_step(self, step: int, flagged: list[str]) -> Event | None:
        """The event for the flags that were set (`flagged`: names from `step_flags`), if any."""
        if not self.per_step or self.now:
            return None
        if UPDATE_METRIC in flagged:
            self.open = self.now = True
            return finding_event(step, self._update_fault(), UPDATE_METRIC, 1.0)
        if flagged:
            self.open = True
            return finding_event(step, None, flagged[0], math.nan)
        return None

    def _update_fault(self) -> FaultSite:
        """The parameter whose update or optimizer state is non-finite; under torch.distributed the
        first one in model order that any rank holds a non-finite piece of (the same on every rank)."""
        found = locate_update_fault(self.model, self.optimizer)
        if not process_group_active():
            return found
        names = [n for n, _ in self.model.named_parameters()]
        first = (found.details.get("params") or [""])[0]
        order = names.index(first) if first in names else len(names)
        agreed = first_across_ranks(found if found.module else None, order)
        return agreed if agreed is not None else found

    def noted(self, event: Event) -> None:
        """A non-finite event decided elsewhere this step (the GradScaler check): a run of them is open."""
        self.open = self.now = True

    def end_step(self) -> None:
        """At `Monitor.step`, after the decisions: release what the step kept."""
        self.now = False
        self._update_bad = None
        self._negative = self._other = None
        self.guard.end_step()

    # ------------------------------------------------------------------ at the log interval
    def decide_row(self, step: int, row: dict[str, float]) -> Event | None:
        """Warn-only: the event of a logged row that holds a non-finite value (once per run of them)."""
        if self.per_step:
            return None
        watched = ("loss",) if self.scaled else ("loss", "grad/global_norm")
        bad: list[str] = [m for m in watched if m in row and not math.isfinite(row[m])]
        bad += [m for m in (OUTPUT_METRIC, GRAD_FLAG, UPDATE_METRIC) if row.get(m, 0.0) > 0]
        origin = self._origins.pop(step, None)
        if not bad:
            self.open = False
            return None
        if self.open:
            return None
        self.open = True
        return finding_event(step, self._origin_site(origin), bad[0], row[bad[0]])

    def _origin_site(self, origin: Origin | None) -> FaultSite | None:
        """The tracer's first producing site of a step decided non-finite (None: no hit). Under
        torch.distributed the ranks agree on one (`first_across_ranks`: the earliest site any rank
        saw), so every rank names the same module: under tensor parallelism a NaN made in one rank's
        shard of a projection reaches the other ranks only through the next collective."""
        finding: FaultSite | None = None
        index = 0
        if origin is not None and bool(origin[0]):  # sync point (on a hit only)
            index = int(origin[1])  # sync point (on a hit only)
            path, pass_, tensor = origin[2][index]
            finding = FaultSite(pass_, path, tensor)
        if origin is not None and process_group_active():  # every rank traces: every rank gets here
            finding = first_across_ranks(finding, index)
        return finding

    def forget_before(self, step: int) -> None:
        """Drop tracer origins of steps up to `step` (after their rows were judged)."""
        self._origins = {s: v for s, v in self._origins.items() if s > step}

    def kept_forwards(self) -> list[Any]:
        """The step's kept forward calls (`stabkit.nonfinite.guard.KeptForward`)."""
        return self.guard.forwards

    def state_dict(self) -> dict[str, Any]:
        """Whether a non-finite run of steps is in progress."""
        return {"open": self.open}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""
        self.open = bool(state.get("open", False))

    def detach(self) -> None:
        """Remove the guard's and tracer's hooks (safe twice)."""
        self.guard.detach()
        if self.tracer is not None:
            self.tracer.detach()
