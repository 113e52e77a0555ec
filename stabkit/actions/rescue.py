"""Action 'rescue': act on the advice — roll back, switch the advised fix on, and continue.

On an event whose advice names a fix that can go on mid-run (`MIDRUN`), in the step the event is
decided: restore the newest snapshot taken at or before the step the trouble began (the event's
``details["since"]`` when its detector says, else the event's step; like 'rollback';
snapshots every `DetectConfig.snapshot_every` steps), switch the fix on, add its new parameters to
the optimizer (own group, no weight decay), scale the learning rate by ``lr_factor``, and report a
``rescue`` event saying exactly what was done (TensorBoard: ``events/rescue``). Before the update
the step's own update is skipped too.

How close each fix is to the identity at the switch (measured on the step's kept inputs and
reported as ``details["output_change"]``, ‖logits after − before‖ / ‖before‖):
- ``z_loss``: exact — it changes only the gradient (no weight, no output changes);
- ``logit_softcap`` / ``attn_softcap``: the cap starts at ``cap_margin`` × the newest logged max
  logit (or the fix's default if larger), where ``c·tanh(x/c)`` is within 1 − tanh(½)·2 ≈ 8 % of x
  at the max and much closer below it;
- ``qk_norm``: the gains start at each module's mean RMS of q and k on the kept inputs, so
  ``γ·q/rms(q) ≈ q`` on average (exact for tokens whose RMS is the mean).

Snapshots taken before a rescue are dropped by it (they lack the fix's parameters): a second
rescue rolls back only as far as the first. Limits: at most ``max_rescues`` per run; other events of the step just rescued (the same drift in
another layer) are reported, not acted on; the same advice signature again on a later step within
``window`` steps of a rescue means it failed: the event and a ``rescue`` failure event are reported and
`stabkit.InstabilityError` stops training. Fixes switched on by a rescue stay on after detach (the
weights were trained with them). Options: ``DetectConfig(options={"rescue": {...}})``.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..events import Event, InstabilityError
from ..plugins import ACTIONS
from .base import Action, ActionContext
from .snapshots import SnapshotStore

MIDRUN = ("qk_norm", "attn_softcap", "z_loss", "logit_softcap")
"""Fixes that can go on mid-run without changing (much) what the model computes at the switch."""


@dataclass(frozen=True)
class RescueOptions:
    """`DetectConfig.options["rescue"]`."""

    max_rescues: int = 2
    """Rescues per run; later events are only reported."""
    window: int = 200
    """The same advice signature again within this many steps of a rescue = the rescue failed."""
    lr_factor: float = 1.0
    """Multiply every param group's learning rate by this at each rescue (0.5 halves it)."""
    cap_margin: float = 2.0
    """Soft caps start at this multiple of the newest logged max logit (or their default, if larger)."""
    fixes: tuple[str, ...] = MIDRUN
    """Fixes a rescue may switch on, in order of preference among those the advice names."""

    def __post_init__(self) -> None:
        if not isinstance(self.max_rescues, int) or self.max_rescues < 1:
            raise ValueError(f"max_rescues must be an integer >= 1, got {self.max_rescues!r}")
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"window must be an integer >= 1, got {self.window!r}")
        if not 0 < self.lr_factor <= 1:
            raise ValueError(f"lr_factor must be in (0, 1], got {self.lr_factor!r}")
        if not self.cap_margin > 1:
            raise ValueError(f"cap_margin must be > 1, got {self.cap_margin!r}")
        unknown = sorted(set(self.fixes) - set(MIDRUN))
        if unknown:
            raise ValueError(f"fixes {unknown} cannot go on mid-run; choose from {list(MIDRUN)}")
        object.__setattr__(self, "fixes", tuple(self.fixes))


@ACTIONS.register
class Rescue(Action):
    """Roll back, switch the advised fix on, continue."""

    name = "rescue"
    order = 20

    def __init__(self, ctx: ActionContext) -> None:
        super().__init__(ctx)
        self.options = ctx.config.options_for(self.name, RescueOptions)
        self.snapshots = SnapshotStore.for_config(ctx.model, ctx.optimizer, ctx.config)
        self.done: list[dict[str, Any]] = []
        """What each rescue did (step, fix, options, restored step, output change): in `state_dict`."""
        self.handles: list[Any] = []

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
        record = self._rescue(event, fixes[0], signature)
        event.details["rescue"] = record
        return before_update

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
            )
        )
        raise InstabilityError(event)

    # ------------------------------------------------------------------ the rescue
    def _rescue(self, event: Event, fix: str, signature: str) -> dict[str, Any]:
        ctx = self.ctx
        began = int(event.details.get("since", event.step))  # where the detector saw the trouble begin
        snap = self.snapshots.newest_before(min(began, event.step))
        if snap is not None:
            self.snapshots.restore(snap)
        inputs = list(ctx.forwards())
        before = _outputs(ctx.model, inputs)
        options = self._options_for(fix)
        from ..interventions import apply

        handle = apply(ctx.model, fix, **options)
        self.handles.append(handle)
        new = handle.new_parameters()
        if fix == "qk_norm":
            _match_gains(ctx.model, inputs)
        if new and ctx.optimizer is not None:
            ctx.optimizer.add_param_group({"params": new, "weight_decay": 0.0})
        # the snapshots so far are of the model without the fix: a later rescue must not restore
        # them (they miss its parameters); the next ones cover them and their optimizer state
        self.snapshots = SnapshotStore.for_config(ctx.model, ctx.optimizer, ctx.config)
        after = _outputs(ctx.model, inputs)
        lr = self._scale_lr()
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
            "new_parameters": sum(p.numel() for p in new),
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
                + (f"; learning rate × {self.options.lr_factor:g}" if self.options.lr_factor != 1 else ""),
                details=dict(record),
            )
        )
        return record

    def _options_for(self, fix: str) -> dict[str, Any]:
        """Options of `fix` at the switch: caps above the newest logged max logit."""
        if fix not in ("attn_softcap", "logit_softcap"):
            return {}
        from ..interventions import REGISTRY

        default = float(REGISTRY[fix].defaults["cap"])
        metrics = self.ctx.metrics()
        if fix == "attn_softcap":
            seen = [v for k, v in metrics.items() if k.startswith("attn/") and k.endswith("/max_logit")]
        else:
            seen = [v for k, v in metrics.items() if k == "logits/max_abs"]
        top = max((v for v in seen if math.isfinite(v)), default=0.0)
        return {"cap": max(default, self.options.cap_margin * top)}

    def _scale_lr(self) -> list[float] | None:
        """Multiply each group's LR (and ``initial_lr``, which torch schedulers start from) by the factor;
        ``lr_scale`` keeps the product for training loops that set the LR themselves."""
        opt = self.ctx.optimizer
        factor = self.options.lr_factor
        if opt is None:
            return None
        for group in opt.param_groups:
            if factor != 1:
                group["lr"] = group["lr"] * factor
                if "initial_lr" in group:
                    group["initial_lr"] = group["initial_lr"] * factor
                group["lr_scale"] = group.get("lr_scale", 1.0) * factor
        return [float(g["lr"]) for g in opt.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"rescues": [dict(r) for r in self.done]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done = [dict(r) for r in state.get("rescues", [])]
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
    from ..detectors.nonfinite import rerun_forward, rng_state, set_rng_state
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


def _match_gains(model: nn.Module, inputs: list[Any]) -> None:
    """qk_norm at the switch: set each HeadNorm's gain to the mean RMS (over tokens and heads) of the
    q or k it normalises on the kept inputs, so the normalised q and k keep their scale."""
    from ..interventions.qknorm import HeadNorm

    norms = [m for m in model.modules() if isinstance(m, HeadNorm)]
    sums: dict[int, list[float]] = {id(m): [0.0, 0.0] for m in norms}

    def measure(module: HeadNorm, args: tuple[Any, ...]) -> None:
        x = args[0].detach().float().unflatten(-1, (-1, module.head_dim))
        entry = sums[id(module)]
        entry[0] += float(x.pow(2).mean(-1).sqrt().sum())
        entry[1] += x[..., 0].numel()

    from ..hooks import DIRECT

    handles = [DIRECT.forward_pre("rescue", m, measure) for m in norms]
    try:
        _outputs(model, inputs)
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        for m in norms:
            total, count = sums[id(m)]
            if count:
                m.weight.fill_(total / count)
