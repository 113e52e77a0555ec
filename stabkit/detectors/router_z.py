"""The 'router_z' kind: a mixture-of-experts router's log Z drifting up from where it started.

Read from ``moe/<layer>/logz_mean`` — the mean over tokens of logsumexp of the router logits, what
ST-MoE's router z-loss squares (Zoph et al. 2022) — on sampled steps; ``moe/<layer>/logit_max`` is
quoted in the message. Large router logits are what ST-MoE's z-loss was made against: in bf16 the
roundoff of a logit grows with its size, and the exponentials of the softmax magnify it. Relative to
the layer's own start (the median of its first `baseline` values: about log E at init):

    router z drift ⇔ the last `persist` values are all at least `level` nats above the start.

One event per drift — a note, then a warning once it passes the danger line or the loss stalls (below);
the layer re-arms once log Z is back below the level. ``details["since"]`` is the
last step log Z was within half the level of its start (where the growth began, for 'rescue').
Healthy tiny routers (HF Mixtral top-2 of 8, OLMoE top-4 of 16, Qwen2-MoE, AdamW 1e-3..3e-3, their
balancing loss on) rose 0.1–0.75 nats in 300 steps, as routers sharpen. A rule on values held, not a
fitted slope: router logits that run away grow geometrically (a router weight growing 5 % a step: log Z
2 → 7 → 76 in 60 steps), and a robust line fitted over a window still mostly flat lags far behind.

**Severity**, as the `drift` kind grades: growth while the model keeps learning is a note ('info'); a
warning once the loss has stopped falling since the growth began (over at least the last `loss_span`
steps), or once the held values are all `danger` nats or more above the start (twice the level, as `drift`'s log Z
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

from ..events import Event
from ..metric_names import MOE, metric, path_of
from ..plugins import DETECTORS
from ..tables import bounds
from .advice import Advice
from .base import Detector, DetectorContext, Observation
from .rolling import grade_by_loss, median_sorted

LOSS_KEPT = 4096
"""Newest losses kept (whether the loss still falls over a window)."""


@dataclass(frozen=True)
class RouterZOptions:
    """``DetectConfig.options["router_z"]``."""

    baseline: int = field(default=5, metadata=bounds(lo=1))
    """First values of a layer whose median is its start."""
    level: float = field(default=3.0, metadata=bounds(lo=0, lo_open=True))
    """Drift: log Z at least this many nats above the start (healthy tiny routers: < 1 in 300 steps)."""
    persist: int = field(default=3, metadata=bounds(lo=1))
    """... in this many consecutive sampled values."""
    danger: float = field(default=6.0, metadata=bounds(lo=0, lo_open=True))
    """Held this many nats above the start: a warning even while the loss falls."""
    loss_span: int = field(default=100, metadata=bounds(lo=1))
    """The fewest steps over which "the loss still falls" is judged (since the growth began when longer)."""


@dataclass
class _Layer:
    first: list[float] = field(default_factory=list)
    run: list[float] = field(default_factory=list)
    """The newest consecutive values at or above the level (at most `persist`)."""
    calm: int | None = None
    """The last step log Z was within half the level of the start."""
    reported: str | None = None
    """The severity this drift was reported at ('info', then 'warning' once it passes the danger line);
    None: not yet (the layer is armed)."""


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
        """An event for each layer whose log Z has just held `level` nats above its start."""
        events = []
        for name, x in values.items():
            if not math.isfinite(x):
                continue
            if name == "loss":
                self.losses.append((step, x))
            elif name.endswith("/logit_max"):
                self.logit_max[path_of(name)] = x
        for name, x in values.items():
            if name.endswith("/logz_mean") and math.isfinite(x):
                event = self._update(step, path_of(name), x)
                if event is not None:
                    events.append(event)
        return Observation(events)

    def _update(self, step: int, path: str, x: float) -> Event | None:
        o = self.options
        s = self.layers.setdefault(path, _Layer())
        if len(s.first) < o.baseline:
            s.first.append(x)
            s.calm = step
            return None
        start = median_sorted(sorted(s.first))
        if x - start < o.level / 2:
            s.calm = step
        if x - start < o.level:
            s.run, s.reported = [], None
            return None
        s.run = [*s.run, x][-o.persist :]
        if s.reported == "warning" or len(s.run) < o.persist:
            return None
        if s.reported == "info" and min(s.run) - start < o.danger:
            return None
        event = self._event(step, path, s, x, start)
        if event.severity == "info" and s.reported == "info":
            return None
        s.reported = event.severity
        return event

    def _event(self, step: int, path: str, s: _Layer, x: float, start: float) -> Event:
        o = self.options
        since = s.calm if s.calm is not None else step
        offset = min(s.run) - start
        severity, why = self._severity(offset, since, step)
        top = self.logit_max.get(path)
        logit = f"; largest router logit {top:.3g}" if top is not None else ""
        return Event(
            step,
            self.kind,
            path,
            x,
            start + o.level,
            f"router z drifting in {path}: mean router log Z is {x:.3g}, {x - start:.2f} nats above its start "
            f"{start:.3g} (≥ {o.level:g} above it for {o.persist} sampled steps; within {o.level / 2:g} of it at "
            f"step {since}){logit} {why}",
            details={
                "layer": path,
                "module": path,
                "series": metric(MOE, path, "logz_mean"),
                "start": start,
                "offset": offset,
                "logit_max": top,
                "since": since,
                "loss_falling": why.startswith("while"),
            },
            severity=severity,
        )

    def _severity(self, offset: float, since: int, step: int) -> tuple[str, str]:
        o = self.options
        if offset >= o.danger:
            return "warning", f"— past its danger line, {o.danger:g} nats above the start"
        start = min(since, step - o.loss_span)
        return grade_by_loss(self.losses, start, step, f"{o.danger:g} nats above the start")

    def rewind(self, step: int) -> None:
        """Forget the held values and arm every layer again (the start stays: it describes the run's
        beginning, which the rollback kept)."""
        for s in self.layers.values():
            s.run, s.reported = [], None

    def state_dict(self) -> dict[str, Any]:
        """Per layer: its first values, the held run, the last calm step and what was reported."""
        return {
            k: {"first": s.first, "run": s.run, "calm": s.calm, "reported": s.reported}
            for k, s in self.layers.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""
        self.layers = {
            k: _Layer(
                [float(v) for v in s["first"]],
                [float(v) for v in s["run"]],
                None if s["calm"] is None else int(s["calm"]),
                s["reported"],
            )
            for k, s in state.items()
        }
