"""The 'expert_collapse' kind: a mixture-of-experts layer whose router sends most tokens to the same
experts, and keeps doing so.

Read from the MoE probe's per-expert token counts ``moe/<layer>/load[e]`` (sampled steps; summed over
micro-batches and ranks) as the layer's *collapse fraction* — MaxVio over the most it can be for top-k
of E, ``MaxVio / (E/k − 1)``, which is also the busiest expert's share placed between balanced (1/E)
and every choice on the same k experts (1/k) (`stabkit.detectors.moe_loads`):

    collapse ⇔ over the last `hold_steps` steps (a span of at least `min_values` sampled values,
               complete: the layer was measured that long), at least the fraction `held` of the
               values are ≥ `level`.

Why these numbers. A tiny 2-layer HF Mixtral (d 64, top-2 of 8, byte text, AdamW, no warmup) without a
balancing loss collapses one layer at LR 3e-3 within 20 steps: fraction 0.9–1.0 (MaxVio 2.7–3.0 of 3)
for 200 steps while the loss keeps falling (the issue's own measurement: MaxVio 3.0, val loss 2.27).
The same model *with* its balancing loss (coefficient 1e-2) — and OLMoE (top-4 of 16) alike — passes
through a transient collapse in its first 20–50 steps (fraction up to 1.0 for 2–4 sampled steps) and
then balances to 0.2–0.6 per step (single batches of 512 tokens, byte text); a tiny Qwen2-MoE (top-2 of
4 beside its shared expert, the same loss, 20 steps of warmup) stays collapsed from step 20 to 110–150
before its balancing loss wins (its aux loss is ≈ k, flat, while the router's probabilities are
near uniform). So the level is high (0.75) and the hold spans 200 steps: the transient passes, a
collapse the balancing cannot undo does not. One event per collapse: a layer re-arms once `min_values` values in a
row are below the level, and its next collapse is judged on a full span from there. The event names the layer and its busiest expert; ``details["since"]`` is
the first step of the held span. Layers unknown to the context (no top-k known) are not judged.

Severity: a warning (what a healthy run never raises): the loss does not show a collapse (Qwen3 #1418,
tt-metal #42869: one expert active and the loss barely showed it), so a falling loss is no excuse.

Runs when the detectors consume values (`stabkit.detectors.base`). Options: `CollapseOptions`
(``DetectConfig.options["expert_collapse"]``). Pure Python; checkpointable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..events import Event
from ..plugins import DETECTORS
from ..tables import bounds
from .advice import Advice
from .base import DetectorContext, Observation
from .moe_loads import ExpertLoadDetector, collapse_fraction, layer_loads


@dataclass(frozen=True)
class CollapseOptions:
    """``DetectConfig.options["expert_collapse"]``."""

    level: float = field(default=0.75, metadata=bounds(lo=0, hi=1, lo_open=True))
    """Collapsed step: MaxVio at least this fraction of its maximum E/k − 1 (top-2 of 8: MaxVio ≥ 2.25,
    the busiest expert ≥ 40.6 % of the choices)."""
    hold_steps: int = field(default=200, metadata=bounds(lo=1))
    """The span, in training steps, over which the collapse must hold (healthy runs' early transients
    last 20–150 steps)."""
    held: float = field(default=0.8, metadata=bounds(lo=0, hi=1, lo_open=True))
    """Fraction of the span's sampled values that must be at or above `level`."""
    min_values: int = field(default=3, metadata=bounds(lo=1))
    """The fewest sampled values a span is judged on (sampled every 100 steps, a 200-step span holds 3)."""


@dataclass
class _Layer:
    recent: deque[tuple[int, float]] = field(default_factory=deque)
    """(step, collapse fraction) of the span (and the value just before it)."""
    first_step: int | None = None
    armed: bool = True


@DETECTORS.register
class ExpertCollapseDetector(ExpertLoadDetector):
    """Expert collapse per MoE layer, from ``moe/<layer>/load[e]``."""

    kind = "expert_collapse"
    options_class = CollapseOptions
    advice: ClassVar[dict[str, Advice]] = {
        "expert_collapse": Advice(
            "a MoE layer's router sends most tokens to the same experts, and holds",
            ("load_balance_loss", "aux_free_balance"),
            "add a load-balancing loss E·Σ f_i·P_i per layer (Switch Transformer / GShard, coefficient 1e-2; "
            "with one global aux loss on, check the layer: a global loss hides per-layer imbalance, Qwen3 #1418) "
            "or DeepSeek-V3's auxiliary-loss-free bias on the routing scores (γ 0.001 per step; the function is "
            "unchanged at the switch: a mid-run fix); a capacity factor (Switch: 1.0–1.25) drops the tokens "
            "past an expert's capacity; a lower router LR slows the collapse",
        ),
    }

    def __init__(self, ctx: DetectorContext) -> None:
        super().__init__(ctx)
        self.options = ctx.options(self.kind, CollapseOptions)
        self.layers: dict[str, _Layer] = {}

    def observe(self, step: int, values: Mapping[str, float]) -> Observation:
        """An event for each MoE layer whose collapse has just held for `hold_steps`."""
        events = []
        for path, load in layer_loads(values).items():
            info = self.ctx.moe_layer(path)
            if info is None:
                continue
            c = collapse_fraction(load, info.top_k)
            if c is None:
                continue
            event = self._update(step, path, c, load, info.top_k)
            if event is not None:
                events.append(event)
        return Observation(events)

    def _update(self, step: int, path: str, c: float, load: list[float], top_k: int) -> Event | None:
        o = self.options
        layer = self.layers.setdefault(path, _Layer())
        if layer.first_step is None:
            layer.first_step = step
        layer.recent.append((step, c))
        while len(layer.recent) > 1 and layer.recent[1][0] <= step - o.hold_steps:
            layer.recent.popleft()  # keep one value at or before the span's start
        span = [(t, v) for t, v in layer.recent if t >= step - o.hold_steps]
        high = sum(v >= o.level for _, v in span)
        if not layer.armed:
            newest = span[-o.min_values :]
            if len(newest) == o.min_values and max(v for _, v in newest) < o.level:
                # re-armed: the next collapse is judged on values from here on (a full span again)
                layer.armed, layer.recent, layer.first_step = True, deque(newest), newest[0][0]
            return None
        complete = step - layer.first_step >= o.hold_steps and len(span) >= o.min_values
        if not complete or high < o.held * len(span):
            return None
        layer.armed = False
        since = next(t for t, v in span if v >= o.level)
        return self._event(step, path, c, load, top_k, since, high, len(span))

    def _event(
        self, step: int, path: str, c: float, load: list[float], top_k: int, since: int, high: int, n: int
    ) -> Event:
        o = self.options
        e = len(load)
        most = e / top_k - 1.0
        total = sum(load)
        mean = total / e
        max_vio = (max(load) - mean) / mean
        busiest = max(range(e), key=load.__getitem__)
        return Event(
            step,
            self.kind,
            path,
            max_vio,
            o.level * most,
            f"expert collapse in {path}: expert {busiest} took {max(load) / total:.0%} of the expert choices "
            f"(MaxVio {max_vio:.3g}; the most it can be for top-{top_k} of {e} is {most:.3g}, balanced 0) — "
            f"at or above {o.level:.0%} of that maximum in {high} of the {n} sampled steps since step "
            f"{step - o.hold_steps}",
            details={
                "layer": path,
                "module": path,
                "collapse": c,
                "max_vio": max_vio,
                "max_vio_max": most,
                "busiest_expert": busiest,
                "busiest_share": max(load) / total,
                "since": since,
            },
        )

    def rewind(self, step: int) -> None:
        """Forget the values from `step` on and arm every layer again."""
        for layer in self.layers.values():
            kept = [(t, v) for t, v in layer.recent if t < step]
            layer.recent = deque(kept)
            layer.armed = True

    def state_dict(self) -> dict[str, Any]:
        """Per layer: the span's values, the first step seen and whether it is armed."""
        return {
            k: {"recent": [list(p) for p in s.recent], "first_step": s.first_step, "armed": s.armed}
            for k, s in self.layers.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""
        self.layers = {
            k: _Layer(
                deque((int(t), float(v)) for t, v in s["recent"]),
                None if s["first_step"] is None else int(s["first_step"]),
                bool(s["armed"]),
            )
            for k, s in state.items()
        }
