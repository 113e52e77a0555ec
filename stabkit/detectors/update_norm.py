"""The 'update_norm' kind: a spike of the Adam update norm ‖θ_new − θ_old‖ — a *leading* signal.

Marin's 32B retrospective saw update-norm spikes of about 2× come before the loss and gradient-norm
spikes, largest in the lower layers. The grad probe logs ``update/norm`` (the whole model) and
``update/<block>/norm`` on sampled steps (`MonitorConfig.every`), rebuilt from the optimizer state.

The rule is the spike detector's (`stabkit.detectors.spike`: the new value against the robust median
and σ of the values before it, upward only), with defaults for a series sampled every N steps: a
shorter window (32 values) and history (8 values), and Marin's 2× as the minimum ratio. A warmup
ramp does not trigger it (the ramp's own spread widens σ), nor does a decay (downward). After an
event a series stays quiet for `cooldown` values, so one burst is one event. Runs when the detectors
consume values (see `stabkit.detectors.base`). Options: `UpdateNormOptions`
(``DetectConfig.options["update_norm"]``). Pure Python; checkpointable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..events import Event
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
    cooldown: int = field(default=8, metadata=bounds(lo=0))
    """Values after an event during which the same series reports no other."""


@DETECTORS.register
class UpdateNormDetector(SpikeDetector):
    """Spikes of ``update/norm`` and ``update/<block>/norm`` (a leading signal, Marin 32B)."""

    kind = "update_norm"
    options_class = UpdateNormOptions
    before_update = ()  # type: ignore[assignment]
    advice: ClassVar[dict[str, Advice]] = {
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
        self.watches = self.options.series  # type: ignore[misc]
        self.series = {}
        self.quiet: dict[str, int] = {}
        """Per series, the values still to pass before it may report again."""

    def observe(self, step: int, values: Mapping[str, float]) -> Observation:
        """A spike event per series whose new value spikes (no score series: the spike detector's)."""
        seen = Observation()
        for name, x in values.items():
            event, _ = self.update(step, name, x)
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

    def signature(self, event: Event) -> str:
        """update_norm_spike."""
        return "update_norm_spike"

    def state_dict(self) -> dict[str, Any]:
        """The spike rule's windows and the cooldowns."""
        return {"series": super().state_dict(), "quiet": dict(self.quiet)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""
        super().load_state_dict(state.get("series", {}))
        self.quiet = {k: int(v) for k, v in state.get("quiet", {}).items()}
