"""The 'router_z' kind: a mixture-of-experts router's log Z drifting up from where it started.

Read from ``moe/<layer>/logz_mean`` — the mean over tokens of logsumexp of the router logits, what
ST-MoE's router z-loss squares (Zoph et al. 2022) — on sampled steps; ``moe/<layer>/logit_max`` is
quoted in the message. Large router logits are what ST-MoE's z-loss was made against: in bf16 the
roundoff of a logit grows with its size, and the exponentials of the softmax magnify it. Like the
`drift` kind's rules, relative to the layer's own start (the median of its first `baseline` values:
about log E at init), once `window` values are kept:

    router z drift ⇔ a robust Theil–Sen slope of the window's log Z whose 95 % interval is above 0,
                     the fitted end at least `level` nats above the start,
                     and a fitted rise of at least `change` nats over the window.

Healthy tiny routers (HF Mixtral top-2 of 8, OLMoE top-4 of 16, Qwen2-MoE, AdamW 1e-3..3e-3, their
balancing loss on) rose 0.1–0.75 nats in 300 steps, as routers sharpen. After an event the layer stays
quiet for one window.

**Severity**, as the `drift` kind grades: growth while the model keeps learning is a note ('info'); a
warning once the loss has stopped falling over the window (or the last `loss_span` steps when longer),
or once the fitted log Z is `danger` nats or more above the start (twice the level, as `drift`'s log Z
danger line is twice its level: the router's logits have grown by ~6 where the softmax's exponentials
of bf16-rounded logits lose their resolution).

Runs when the detectors consume values (`stabkit.detectors.base`). Options: `RouterZOptions`
(``DetectConfig.options["router_z"]``). Pure Python; checkpointable.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..events import Event
from ..plugins import DETECTORS
from ..tables import bounds
from .advice import Advice
from .base import Detector, DetectorContext, Observation
from .rolling import median_sorted

LOSS_KEPT = 4096
"""Newest losses kept (whether the loss still falls over a window)."""


@dataclass(frozen=True)
class RouterZOptions:
    """``DetectConfig.options["router_z"]``."""

    window: int = field(default=20, metadata=bounds(lo=5, hint="a slope needs points"))
    """Values (sampled steps) in the robust-slope window of each layer's log Z."""
    baseline: int = field(default=5, metadata=bounds(lo=1))
    """First values of a layer whose median is its start."""
    level: float = field(default=3.0, metadata=bounds(lo=0, lo_open=True))
    """Drift only once the fitted log Z is at least this many nats above the start (healthy: < 1)."""
    change: float = field(default=0.5, metadata=bounds(lo=0, lo_open=True))
    """... and rose at least this many nats over the window."""
    danger: float = field(default=6.0, metadata=bounds(lo=0, lo_open=True))
    """A drift this many nats above the start is a warning even while the loss falls."""
    loss_span: int = field(default=100, metadata=bounds(lo=1))
    """The fewest steps over which "the loss still falls" is judged (the window's span when longer)."""


@dataclass
class _Layer:
    window: deque[tuple[int, float]]
    first: list[float] = field(default_factory=list)
    seen: int = 0
    quiet_until: int = 0


@DETECTORS.register
class RouterZDetector(Detector):
    """Router log Z drift per MoE layer, from ``moe/<layer>/logz_mean``."""

    kind = "router_z"
    options_class = RouterZOptions
    watches = ("moe/*/logz_mean", "moe/*/logit_max", "loss")
    advice: ClassVar[dict[str, Advice]] = {
        "router_z_drift": Advice(
            "a MoE router's log Z keeps growing",
            ("router_z_loss", "router_fp32"),
            "add ST-MoE's router z-loss 1e-3·mean(log Z²) over the router logits (Zoph et al. 2022; a mid-run "
            "fix: it changes only gradients) or compute the router in fp32 (Switch Transformer's selective "
            "precision: bf16 rounds large router logits); a lower router LR also slows it",
        ),
    }

    def __init__(self, ctx: DetectorContext) -> None:
        super().__init__(ctx)
        self.options = ctx.options(self.kind, RouterZOptions)
        self.layers: dict[str, _Layer] = {}
        self.logit_max: dict[str, float] = {}
        self.losses: deque[tuple[int, float]] = deque(maxlen=LOSS_KEPT)

    def observe(self, step: int, values: Mapping[str, float]) -> Observation:
        """An event for each layer whose log Z window shows sustained growth past the level."""
        events = []
        for name, x in values.items():
            if not math.isfinite(x):
                continue
            if name == "loss":
                self.losses.append((step, x))
            elif name.endswith("/logit_max"):
                self.logit_max[name.removeprefix("moe/").removesuffix("/logit_max")] = x
        for name, x in values.items():
            if name.endswith("/logz_mean") and math.isfinite(x):
                event = self._update(step, name.removeprefix("moe/").removesuffix("/logz_mean"), x)
                if event is not None:
                    events.append(event)
        return Observation(events)

    def _update(self, step: int, path: str, x: float) -> Event | None:
        o = self.options
        s = self.layers.get(path)
        if s is None:
            s = self.layers[path] = _Layer(deque(maxlen=o.window))
        s.window.append((step, x))
        s.seen += 1
        if len(s.first) < o.baseline:
            s.first.append(x)
        if len(s.window) < o.window or s.seen < s.quiet_until:
            return None
        start = median_sorted(sorted(s.first))
        if x - start < o.level:  # the usual answer, before any array is made
            return None
        steps = np.array([t for t, _ in s.window], dtype=np.float64)
        y = np.array([v for _, v in s.window], dtype=np.float64)
        from scipy.stats import theilslopes  # scipy.stats is slow to import: load on the first fit

        slope, intercept, low, _high = theilslopes(y, steps)
        rise = slope * (steps[-1] - steps[0])
        end = intercept + slope * steps[-1]
        if not (low > 0 and end - start >= o.level and rise >= o.change):
            return None
        s.quiet_until = s.seen + o.window
        return self._event(path, s, x, start, end, rise, slope)

    def _event(
        self, path: str, s: _Layer, x: float, start: float, end: float, rise: float, slope: float
    ) -> Event:
        o = self.options
        step, first = s.window[-1][0], s.window[0][0]
        severity, why = self._severity(end - start, first, step)
        top = self.logit_max.get(path)
        logit = f"; largest router logit {top:.3g}" if top is not None else ""
        return Event(
            step,
            self.kind,
            path,
            x,
            start + o.level,
            f"router z drifting in {path}: mean router log Z rose {rise:.2f} nats over the last {step - first} "
            f"steps (robust slope > 0) to {x:.3g}, {end - start:.2f} nats above its start {start:.3g}{logit} {why}",
            details={
                "layer": path,
                "module": path,
                "series": f"moe/{path}/logz_mean",
                "start": start,
                "offset": end - start,
                "slope": slope,
                "logit_max": top,
                "since": first,
                "loss_falling": why.startswith("while"),
            },
            severity=severity,
        )

    def _severity(self, offset: float, first: int, step: int) -> tuple[str, str]:
        o = self.options
        if offset >= o.danger:
            return "warning", f"— past its danger line, {o.danger:g} nats above the start"
        falling = self._loss_falls(min(first, step - o.loss_span), step)
        if falling is None:
            return "warning", "— the loss is not known to be falling"
        if not falling:
            return "warning", "— and the loss has stopped falling"
        return (
            "info",
            f"while the loss still falls (a note: a warning {o.danger:g} nats above the start or once the loss stalls)",
        )

    def _loss_falls(self, start: int, end: int) -> bool | None:
        """The median of the last third of the losses in `start`..`end` below that of the first third
        (None: fewer than 6 losses)."""
        values = [v for t, v in self.losses if start <= t <= end]
        if len(values) < 6:
            return None
        third = len(values) // 3
        return median_sorted(sorted(values[-third:])) < median_sorted(sorted(values[:third]))

    def rewind(self, step: int) -> None:
        """Forget every window value from `step` on, and the cooldowns (the start stays)."""
        for s in self.layers.values():
            kept = [(t, v) for t, v in s.window if t < step]
            s.window.clear()
            s.window.extend(kept)
            s.quiet_until = 0

    def state_dict(self) -> dict[str, Any]:
        """Per layer: its window, first values and cooldown."""
        return {
            k: {
                "window": [list(p) for p in s.window],
                "first": s.first,
                "seen": s.seen,
                "quiet_until": s.quiet_until,
            }
            for k, s in self.layers.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""
        self.layers = {}
        for k, s in state.items():
            window: deque[tuple[int, float]] = deque(maxlen=self.options.window)
            window.extend((int(t), float(v)) for t, v in s["window"])
            self.layers[k] = _Layer(
                window, [float(v) for v in s["first"]], int(s["seen"]), int(s["quiet_until"])
            )
