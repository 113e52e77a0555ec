"""Action 'rescue': act on the advice — roll back, switch the advised fix on, and continue.

On an event whose advice names a fix that can go on mid-run (`midrun_fixes`: the registered
interventions with ``midrun = True``, read live from `stabkit.plugins.INTERVENTIONS`), in the step the
event is decided: restore the newest snapshot taken at or before the step the trouble began (the
event's ``details["since"]`` when its detector says, else the event's step; like 'rollback';
snapshots every `DetectConfig.snapshot_every` steps; none with ``rollback`` False), tell the detectors to forget the steps rolled
back (`ActionContext.rewound`), switch the fix on (with its plug-in's `midrun_options`, then
``fix_options[fix]`` over them, then `match_at_switch`; a fix that acts after optimizer steps —
``qk_clip`` — watches the optimizer from then on, its metrics recorded by the monitor), add its new
parameters to the optimizer (own group, no weight decay), lower the learning rate by ``lr_factor``
and re-warm it over ``rewarm_steps`` (see below), and report a ``rescue`` event saying exactly what
was done (TensorBoard: ``events/rescue``). Before the update the step's own update is skipped too.

How close each fix is to the identity at the switch (measured on the step's kept inputs and
reported as ``details["output_change"]``, ‖logits after − before‖ / ‖before‖):
- ``qk_clip`` (the first choice for attention-logit growth): exact — it changes no forward and no
  weight until a head's max logit passes τ, after the next optimizer step;
- ``z_loss``: exact — it changes only the gradient (no weight, no output changes);
- ``logit_softcap`` / ``attn_softcap``: the cap starts at ``cap_margin`` × the newest logged max
  logit (or the fix's default if larger), where ``c·tanh(x/c)`` is within 1 − tanh(½)·2 ≈ 8 % of x
  at the max and much closer below it;
- ``qk_norm``: the gains start at each module's mean RMS of q and k on the kept inputs, so
  ``γ·q/rms(q) ≈ q`` on average (exact for tokens whose RMS is the mean).

The learning rate (``lr_factor`` < 1) is lowered through optimizer step hooks, never by editing
``param_group["lr"]`` between steps, where a schedule would undo it (`LambdaLR`, `OneCycleLR`, a loop
that sets the LR each step) or compound it (`ExponentialLR`). At attach the rescue registers a step
pre-hook that multiplies every group's ``lr`` by the product of the rescues' factors just before the
update, and a step post-hook that puts the schedule's value back (`stabkit.actions.lr_factor`): any
loop and any torch scheduler work on their own values, every update uses schedule × factor, and
``details["lr"]`` gives the rates in force after the rescue. The factor is in `state_dict` (a resumed
run keeps it). ``rewarm_steps`` N > 0 re-warms through the same hooks: the k-th update after a rescue
runs at ``rewarm_from + (1 − rewarm_from)·k/N`` of the rate (× the factor), back to the full rate
after N updates (Marin re-warmed its 32B run over 1000 steps after switching QK-norm on mid-run; on
the tiny recipes a re-warmup as long as the warmup is what made the rescues hold). The hooks go through the Monitor's hooks (``ctx.hooks``, owner 'rescue': listed by
``describe_hooks``, removed at detach, after which the optimizer steps at its schedule's rate). A torch scheduler counts the groups it was
built with: a fix that adds parameters (``qk_norm``) adds a group that a scheduler built before the
rescue refuses at its next step — with such a scheduler, choose ``fixes`` without new parameters.

Snapshots taken before a rescue are dropped by it (they lack the fix's parameters): a second
rescue rolls back only as far as the first. Limits: at most ``max_rescues`` per run; other events
of the step just rescued (the same drift in another layer) are reported, not acted on; the same
advice signature again on a later step within ``window`` steps of a rescue means it failed: the event
and a ``rescue`` failure event are reported and `stabkit.InstabilityError` stops training. Fixes switched on by a rescue stay on after detach (the
weights were trained with them). Options: ``DetectConfig(options={"rescue": {...}})``.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..events import Event, InstabilityError
from ..hooks import DIRECT
from ..plugins import ACTIONS, INTERVENTIONS, LiveNames
from ..tables import bounds
from .base import Action, ActionContext
from .lr_factor import LRFactor
from .snapshots import Snapshot, SnapshotStore


def midrun_fixes() -> tuple[str, ...]:
    """The registered interventions that can go on mid-run, most preferred first
    (`Intervention.midrun_preference`, then registration order). Read when called: a plug-in
    registered after import is included."""
    names = INTERVENTIONS.names()
    classes = {n: INTERVENTIONS.load(n) for n in names}
    rank = {n: i for i, n in enumerate(names)}
    fixes = [n for n in names if getattr(classes[n], "midrun", False)]
    return tuple(sorted(fixes, key=lambda n: (getattr(classes[n], "midrun_preference", 100), rank[n])))


MIDRUN = LiveNames(midrun_fixes)
"""Fixes that can go on mid-run without changing (much) what the model computes at the switch (a
live view of `midrun_fixes`: qk_norm, attn_softcap, z_loss, logit_softcap and any registered later)."""


@dataclass(frozen=True)
class RescueOptions:
    """`DetectConfig.options["rescue"]`."""

    max_rescues: int = field(default=2, metadata=bounds(lo=1))
    """Rescues per run; later events are only reported."""
    window: int = field(default=200, metadata=bounds(lo=1))
    """The same advice signature again within this many steps of a rescue = the rescue failed."""
    lr_factor: float = field(default=1.0, metadata=bounds(lo=0.0, hi=1.0, lo_open=True))
    """Multiply every param group's learning rate by this at each rescue (0.5 halves it), inside each
    optimizer step from then on, over whatever the user's schedule sets (see the module docstring)."""
    cap_margin: float = field(default=2.0, metadata=bounds(lo=1.0, lo_open=True))
    """Soft caps start at this multiple of the newest logged max logit (or their default, if larger)."""
    fixes: tuple[str, ...] = field(default_factory=midrun_fixes)
    """Fixes a rescue may switch on, in order of preference among those the advice names (default:
    every mid-run fix registered when the options are made, `midrun_fixes`: qk_clip first)."""
    fix_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Options of a fix at the switch, by fix, over its own mid-run options (e.g.
    ``{"qk_clip": {"tau": 30.0}}``)."""
    rewarm_steps: int = field(default=0, metadata=bounds(lo=0))
    """After each rescue, bring the learning rate back over this many optimizer steps: linearly from
    `rewarm_from` × the schedule's rate to the schedule's (Marin's 32B run re-warmed over 1000 steps
    after switching QK-norm on mid-run); 0: none."""
    rewarm_from: float = field(default=0.1, metadata=bounds(lo=0.0, hi=1.0, lo_open=True))
    """The fraction of the schedule's rate the re-warmup starts from."""
    rollback: bool = True
    """False: switch the fix on where the run is, without restoring a snapshot — for a fix that is
    exact at the switch and undoes the trouble from there (``aux_free_balance`` moves a collapsed
    router back towards balance; rolling back would only throw the steps since away)."""

    def __post_init__(self) -> None:
        # the ranges are the fields' `bounds` (checked by DetectConfig); this is the one check they cannot say
        allowed = midrun_fixes()
        unknown = sorted(set(self.fixes) - set(allowed))
        if unknown:
            raise ValueError(
                f"RescueOptions.fixes {unknown} cannot go on mid-run; choose from {list(allowed)}"
            )
        object.__setattr__(self, "fixes", tuple(self.fixes))
        stray = sorted(set(self.fix_options) - set(allowed))
        if stray:
            raise ValueError(
                f"RescueOptions.fix_options names {stray}, which cannot go on mid-run; choose from {list(allowed)}"
            )


@ACTIONS.register
class Rescue(Action):
    """Roll back, switch the advised fix on, continue."""

    name = "rescue"
    order = 20
    options_class = RescueOptions

    def __init__(self, ctx: ActionContext) -> None:
        super().__init__(ctx)
        self.options = ctx.config.options_for(self.name, RescueOptions)
        self.snapshots = SnapshotStore.for_config(ctx.model, ctx.optimizer, ctx.config)
        self.done: list[dict[str, Any]] = []
        """What each rescue did (step, fix, options, restored step, output change): in `state_dict`."""
        self.handles: list[Any] = []
        self.lr = LRFactor(ctx.optimizer) if ctx.optimizer is not None else None
        """The learning-rate factor in force (`stabkit.actions.lr_factor`)."""
        if self.options.lr_factor != 1 or self.options.rewarm_steps:
            self._lr_hooks()

    def _lr_hooks(self) -> None:
        """Register the learning-rate factor's step hooks (at attach, or when a resumed state has a
        factor): through the Monitor's hooks (``ctx.hooks``, under 'rescue': listed by
        `Monitor.describe_hooks`, removed at detach), or directly on the optimizer for a context built
        by hand without them."""
        if self.lr is not None and not self.lr.attached:
            self.lr.attach(self.ctx.hooks or DIRECT, self.name)

    def before_update(self, step: int) -> None:
        if self.snapshots.due(step):
            self.snapshots.take(step)

    # ------------------------------------------------------------------ the decision
    def run(self, event: Event, before_update: bool) -> bool:
        signature = str(event.details.get("advice", event.kind))
        latest = self.done[-1] if self.done else None
        if latest is not None and event.step == latest["step"]:
            # another event of the step just rescued (e.g. the same drift in a second layer): the
            # rescue has not had a step to work yet, so this is neither a failure nor a new rescue
            event.details["rescue"] = f"not attempted: rescued at this step already ({latest['fix']})"
            return False
        previous = next((r for r in reversed(self.done) if r["signature"] == signature), None)
        if previous is not None and event.step - previous["step"] <= self.options.window:
            self._fail(event, previous)
        if len(self.done) >= self.options.max_rescues:
            event.details["rescue"] = (
                f"not attempted: the limit of {self.options.max_rescues} rescue(s) is reached"
            )
            return False
        from ..interventions import active_interventions

        active = set(active_interventions(self.ctx.model))
        named = [f for f in event.details.get("interventions", []) if f not in active]
        fixes = [f for f in self.options.fixes if f in named]
        if not fixes:
            why = "no fix it names can go on mid-run" if named else "it names no fix that is not already on"
            event.details["rescue"] = (
                f"not attempted: {why} (advice: {event.details.get('interventions', [])})"
            )
            return False
        snap = self._roll_back(event) if self.options.rollback else None
        refused: list[str] = []
        for fix in fixes:  # in order of preference; a fix that refuses this model hands on to the next
            record = self._rescue(event, fix, signature, snap, refused)
            if record is not None:
                event.details["rescue"] = record
                return before_update
        back = f"rolled back to before step {snap.step}, but " if snap is not None else "not attempted: "
        event.details["rescue"] = f"{back}every fix it names refused this model ({'; '.join(refused)})"
        return before_update and snap is not None

    def _fail(self, event: Event, previous: dict[str, Any]) -> None:
        gap = event.step - previous["step"]
        event.details["rescue"] = (
            f"failed: the same signature ({previous['signature']}) again {gap} steps after the rescue at "
            f"step {previous['step']} ({previous['fix']})"
        )
        self.ctx.report(event)
        self.ctx.report(
            Event(
                event.step,
                "rescue",
                previous["fix"],
                float(gap),
                float(self.options.window),
                f"rescue failed: {event.details['rescue']}; stopping",
                details={"failed": True, "rescued_at": previous["step"], "signature": previous["signature"]},
                severity="critical",
            )
        )
        if self.lr is not None:
            self.lr.restore()  # the step stops in its pre-hook: leave the schedule's learning rates
        raise InstabilityError(event)

    # ------------------------------------------------------------------ the rescue
    def _roll_back(self, event: Event) -> Snapshot | None:
        """Restore the newest snapshot from before the trouble began (None: there is none)."""
        began = int(event.details.get("since", event.step))  # where the detector saw the trouble begin
        snap = self.snapshots.newest_before(min(began, event.step))
        if snap is not None:
            self.snapshots.restore(snap)
            self.ctx.rewound(snap.step)  # the detectors' windows forget the trajectory rolled back
        return snap

    def _rescue(
        self, event: Event, fix: str, signature: str, snap: Snapshot | None, refused: list[str]
    ) -> dict[str, Any] | None:
        """Switch `fix` on the rolled-back model; None (and why, appended to `refused`) when the fix
        refuses this model (`InterventionError`: nothing applied)."""
        ctx = self.ctx
        inputs = list(ctx.forwards())
        before = _outputs(ctx.model, inputs)
        plugin = INTERVENTIONS.load(fix)()
        options = plugin.midrun_options(ctx.metrics(), self.options.cap_margin)
        options.update(self.options.fix_options.get(fix, {}))
        from ..interventions import InterventionError, apply, join_optimizer

        try:
            handle = apply(ctx.model, fix, **options)
        except InterventionError as exc:
            refused.append(f"{fix}: {exc}")
            return None
        self.handles.append(handle)
        new = handle.new_parameters()
        plugin.match_at_switch(ctx.model, handle, lambda: _outputs(ctx.model, inputs))
        join_optimizer(handle, ctx.optimizer, ctx.record)  # qk_clip watches it; new gains join it
        # the snapshots so far are of the model without the fix: a later rescue must not restore
        # them (they miss its parameters); the next ones cover them and their optimizer state
        self.snapshots = SnapshotStore.for_config(ctx.model, ctx.optimizer, ctx.config)
        after = _outputs(ctx.model, inputs)
        lr = self._scale_lr()
        if self.lr is not None and self.options.rewarm_steps:
            self.lr.rewarm(self.options.rewarm_steps, self.options.rewarm_from)
        change = _change(before, after)
        record: dict[str, Any] = {
            "step": event.step,
            "signature": signature,
            "fix": fix,
            "options": options,
            "restored_step": snap.step if snap is not None else None,
            "steps_lost": event.step - snap.step if snap is not None else 0,
            "output_change": change,
            "lr_factor": self.options.lr_factor,
            "lr": lr,
            "rewarm_steps": self.options.rewarm_steps,
            "new_parameters": sum(p.numel() for p in new),
            "refused": list(refused),
        }
        self.done.append(record)
        restored = (
            f"rolled back to before step {snap.step}, "
            if snap is not None
            else "no snapshot to roll back to, "
        )
        moved = f"; output changed by {change:.2g} at the switch" if change is not None else ""
        ctx.report(
            Event(
                event.step,
                "rescue",
                fix,
                change if change is not None else 0.0,
                0.0,
                f"rescue {len(self.done)}/{self.options.max_rescues} after {signature}: {restored}switched on "
                f"{fix}{_describe(options)}{moved}"
                + (f"; learning rate × {self.options.lr_factor:g}" if self.options.lr_factor != 1 else "")
                + (
                    f"; learning rate re-warmed from {self.options.rewarm_from:g}× over {self.options.rewarm_steps} steps"
                    if self.options.rewarm_steps
                    else ""
                ),
                details=dict(record),
            )
        )
        return record

    def _scale_lr(self) -> list[float] | None:
        """Lower the learning rate by ``lr_factor`` from the next optimizer step on (the factor held by
        `LRFactor`); the learning rates each group now steps with."""
        if self.lr is None:
            return None
        self.lr.factor *= self.options.lr_factor
        return self.lr.effective()

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"rescues": [dict(r) for r in self.done]}
        if self.lr is not None and self.lr.warming:
            state["rewarm"] = self.lr.warm_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done = [dict(r) for r in state.get("rescues", [])]
        if self.lr is not None:  # the learning-rate factor of the rescues so far
            self.lr.factor = 1.0
            for record in self.done:
                self.lr.factor *= float(record.get("lr_factor", 1.0))
            if "rewarm" in state:
                self.lr.load_warm_state(state["rewarm"])
            if self.lr.factor != 1 or self.lr.warming:
                self._lr_hooks()  # between steps (Monitor.load_state_dict): registering is safe
        from ..interventions import active_interventions

        missing = sorted({r["fix"] for r in self.done} - set(active_interventions(self.ctx.model)))
        if missing:
            specs = [(r["fix"], r["options"]) for r in self.done if r["fix"] in missing]
            warnings.warn(
                f"stabkit: this run was rescued before the checkpoint ({', '.join(missing)} switched on mid-run), "
                f"but the model has no {', '.join(missing)} now; attach with interventions={specs!r} before "
                "loading the weights, or the run continues without the fix",
                RuntimeWarning,
                stacklevel=3,
            )


def _describe(options: dict[str, Any]) -> str:
    return " (" + ", ".join(f"{k}={v:.4g}" for k, v in options.items()) + ")" if options else ""


def _outputs(model: nn.Module, inputs: list[Any]) -> list[torch.Tensor]:
    """The model's main output on each kept forward, re-run with the step's own RNG state and autocast
    (so before and after the switch see the same dropout masks); no grad; the RNG is restored."""
    from ..nonfinite.guard import rerun_forward, rng_state, set_rng_state
    from ..probes import first_tensor

    outs = []
    saved = rng_state()
    try:
        with torch.no_grad():
            for fwd in inputs:
                with contextlib.suppress(TypeError):
                    outs.append(first_tensor(rerun_forward(model, fwd)).detach().float().clone())
    finally:
        set_rng_state(*saved)
    return outs


def _change(before: list[torch.Tensor], after: list[torch.Tensor]) -> float | None:
    """‖after − before‖ / ‖before‖ over the kept forwards (None without any)."""
    if not before or len(before) != len(after):
        return None
    num = sum(float((a - b).pow(2).sum()) for a, b in zip(after, before, strict=True))
    den = sum(float(b.pow(2).sum()) for b in before)
    return math.sqrt(num / den) if den > 0 else None
