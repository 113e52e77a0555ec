"""The 'update_norm' kind: a spike of the Adam update norm ‖θ_new − θ_old‖ — a *leading* signal.

Marin's 32B retrospective saw update-norm spikes of about 2× come before the loss and gradient-norm
spikes, largest in the lower layers. The grad probe logs ``update/norm`` (the whole model) and
``update/<block>/norm`` on sampled steps (`MonitorConfig.every`), rebuilt from the optimizer state.

The rule is the spike detector's (`stabkit.detectors.spike`: the new value against the recent level
and the step-to-step noise of the values before it, upward only), with defaults for a series sampled
every N steps: a shorter window (32 values) and history (8 values), and Marin's 2× as the minimum
ratio. The norm is judged per unit of the optimizer's learning rate of the step (``opt/lr``): on
Hugging Face GPT-2 at LR 3e-3 with 100 warmup steps the raw update norm doubled with the ramp (an
event at step 52 of a healthy run); per unit of LR it is flat. A decay is downward: never a spike. After an
event a series stays quiet for `cooldown` values, so one burst is one event. Runs when the detectors
consume values (see `stabkit.detectors.base`). Options: `UpdateNormOptions`
(``DetectConfig.options["update_norm"]``). Pure Python; checkpointable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..events import Event
from ..learning_rate import LR_SERIES
from ..plugins import DETECTORS
from ..tables import bounds
from .advice import Advice
from .base import Detector, DetectorContext, Observation
from .spike import SpikeDetector, SpikeOptions


def _update_min_ratio() -> dict[str, float]:
    return {"*": 2.0}


@dataclass(frozen=True)
class UpdateNormOptions(SpikeOptions):
    """``DetectConfig.options["update_norm"]`` (the spike rule's fields, with these defaults)."""

    series: tuple[str, ...] = ("update/norm", "update/*/norm")
    """Globs of the update-norm series watched."""
    window: int = field(default=32, metadata=bounds(lo=1))
    """Values (sampled steps) in the rolling window."""
    min_ratio: dict[str, float] = field(default_factory=_update_min_ratio, metadata=bounds(lo=1))
    """Glob -> the value must also be at least this multiple of the rolling median (Marin: ~2×)."""
    min_history: int = field(default=8, metadata=bounds(lo=2))
    """Values a series needs before it can spike."""
    per_lr: tuple[str, ...] = ("update/*",)
    """Globs of the series divided by the step's learning rate (``opt/lr``) before they are judged:
    Adam's update norm is the LR times a normalised step, so a warmup that doubles the LR doubles it."""
    cooldown: int = field(default=8, metadata=bounds(lo=0))
    """Values after an event during which the same series reports no other."""
    warn: tuple[str, ...] = ()
    """Globs of the update-norm series whose spike is a 'warning'; by default every update-norm spike
    is a note: at this scale it never led a lost run (the lead-time table), and its incident becomes a
    warning when the loss spikes with it."""
    lr_jump: float | None = field(default=4.0, metadata=bounds(lo=1, lo_open=True))
    """The learning rate rising at least this many times over the previous step's in one step is
    an event of its own (update norms are judged per unit of LR, so they no longer show it): a
    'warning' when the new rate is at least twice any rate of the run before, else (a restart to a
    rate used before, SGDR) a note. A linear warmup doubles the rate at most (its first step).
    None = off."""


@DETECTORS.register
class UpdateNormDetector(SpikeDetector):
    """Spikes of ``update/norm`` and ``update/<block>/norm`` (a leading signal, Marin 32B)."""

    kind = "update_norm"
    options_class = UpdateNormOptions
    before_update = ()  # type: ignore[assignment]
    advice: ClassVar[dict[str, Advice]] = {
        "lr_jump": Advice(
            "the learning rate jumped within one step",
            (),
            "check the schedule and any code that writes param_groups[i]['lr'] (a restart or a unit "
            "mistake): a sudden rise of the rate makes the next updates as large as the jump",
        ),
        "update_norm_spike": Advice(
            "Adam update-norm spike (leads loss and gradient-norm spikes)",
            (),
            "Marin 32B retrospective: update-norm spikes of ~2× came before loss spikes, largest in the lower "
            "layers — lower the learning rate or clip updates (action 'clip', ZClip), check Adam ε and β₂ "
            "(Wortsman et al. 2023 §3.4: a too-small ε lets rare-gradient parameters take huge steps)",
        ),
    }

    def __init__(self, ctx: DetectorContext) -> None:
        Detector.__init__(self, ctx)
        self.options: UpdateNormOptions = ctx.options(self.kind, UpdateNormOptions)
        self.watches = (*self.options.series, LR_SERIES)  # type: ignore[misc]
        self.series = {}
        self._per_lr = {}
        self._warns = {}
        self.quiet: dict[str, int] = {}
        """Per series, the values still to pass before it may report again."""
        self.lr_prev: float | None = None
        self.lr_max = 0.0

    def observe(self, step: int, values: Mapping[str, float]) -> Observation:
        """A spike event per series whose new value spikes (no score series: the spike detector's)."""
        seen = Observation()
        lr = values.get(LR_SERIES)
        if lr is not None:
            jump = self._lr_jump(step, lr)
            if jump is not None:
                seen.events.append(jump)
        for name, event, _ in self.judged(step, values):
            left = self.quiet.get(name, 0)
            if left:
                self.quiet[name] = left - 1
                continue
            if event is not None:
                event.kind = self.kind
                event.message = f"{event.message}; update-norm spikes lead loss spikes (Marin 32B)"
                self.quiet[name] = self.options.cooldown
                seen.events.append(event)
        return seen

    def _lr_jump(self, step: int, lr: float) -> Event | None:
        """An event when `lr` is at least `lr_jump` times the previous step's rate."""
        prev, top = self.lr_prev, self.lr_max
        self.lr_prev, self.lr_max = lr, max(top, lr)
        factor = self.options.lr_jump
        if factor is None or prev is None or not prev > 0 or lr < factor * prev:
            return None
        new_high = lr >= 2 * top
        return Event(
            step,
            self.kind,
            LR_SERIES,
            lr,
            factor * prev,
            f"the learning rate rose {lr / prev:.1f}× in one step ({prev:.3g} -> {lr:.3g})"
            + ("" if new_high else f"; the run used {top:.3g} before (a restart)"),
            details={"lr": lr, "previous": prev, "highest_before": top, "ratio": lr / prev},
            severity="warning" if new_high else "info",
        )

    def signature(self, event: Event) -> str:
        """lr_jump for the learning rate's own event, else update_norm_spike."""
        return "lr_jump" if event.where == LR_SERIES else "update_norm_spike"

    def state_dict(self) -> dict[str, Any]:
        """The spike rule's windows and the cooldowns."""
        return {
            "series": super().state_dict(),
            "quiet": dict(self.quiet),
            "lr": [self.lr_prev, self.lr_max],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""
        super().load_state_dict(state.get("series", {}))
        self.quiet = {k: int(v) for k, v in state.get("quiet", {}).items()}
        prev, top = state.get("lr", [None, 0.0])
        self.lr_prev, self.lr_max = (None if prev is None else float(prev)), float(top)
