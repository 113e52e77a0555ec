"""The 'dead_experts' kind: experts of a mixture-of-experts layer that stop getting tokens, and stay so.

Read from the MoE probe's per-expert token counts ``moe/<layer>/load[e]`` (sampled steps; summed over
micro-batches and ranks). An expert is dead when no sampled step of the last `window` training steps
gave it a token — the definition of the probe's ``moe/<layer>/dead_experts`` (NeMo Automodel's
dead-expert count) — and at least `min_values` sampled steps saw it so (sampled every 100 steps, a
100-step window holds one, and one batch without a token is chance for a rarely chosen expert). An
expert never routed since attach counts from the first step the layer was measured.

One event per layer each time its set of dead experts gains members, naming the layer and the experts
newly dead (an expert that gets a token again leaves the set, and is reported again if it dies again);
``details["since"]`` is the last step any of them had a token. A warning: an expert without tokens gets
no gradient through the router's choice and does not come back on its own; a healthy run keeps every
expert fed (the corpus' MoE runs: none dead).

Runs when the detectors consume values (`stabkit.detectors.base`). Options: `DeadOptions`
(``DetectConfig.options["dead_experts"]``). Pure Python; checkpointable.
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
from .moe_loads import is_load, layer_loads


@dataclass(frozen=True)
class DeadOptions:
    """``DetectConfig.options["dead_experts"]``."""

    window: int = field(default=100, metadata=bounds(lo=1))
    """Training steps without a token after which an expert is dead (the MoE probe's window)."""
    min_values: int = field(default=5, metadata=bounds(lo=1))
    """... seen so in at least this many sampled steps."""


@dataclass
class _Layer:
    last: list[int]
    """Per expert, the last step it had a token (the layer's first measured step when it never had)."""
    empty: list[int]
    """Per expert, sampled steps without a token since `last`."""
    dead: set[int] = field(default_factory=set)
    """Experts reported dead and not fed since."""


@DETECTORS.register
class DeadExpertsDetector(Detector):
    """Newly dead experts per MoE layer, from ``moe/<layer>/load[e]``."""

    kind = "dead_experts"
    options_class = DeadOptions
    advice: ClassVar[dict[str, Advice]] = {
        "dead_experts": Advice(
            "experts of a MoE layer get no token any more",
            ("aux_free_balance", "load_balance_loss"),
            "an expert the router never picks gets no gradient through the choice and stays dead: DeepSeek-V3's "
            "auxiliary-loss-free bias raises the scores of under-loaded experts until they are picked again "
            "(γ 0.001 per step, a mid-run fix), a load-balancing loss (Switch / GShard, 1e-2) pulls their router "
            "probability up; a lower router LR, or the router in fp32, keeps it from over-committing",
        ),
    }

    def __init__(self, ctx: DetectorContext) -> None:
        super().__init__(ctx)
        self.options = ctx.options(self.kind, DeadOptions)
        self.layers: dict[str, _Layer] = {}

    def wants(self, name: str) -> bool:
        """The per-expert token counts (the names hold '[', which globs read as a class)."""
        hit = self._wants.get(name)
        if hit is None:
            hit = self._wants[name] = is_load(name)
        return hit

    def observe(self, step: int, values: Mapping[str, float]) -> Observation:
        """An event for each MoE layer with experts newly dead at `step`."""
        events = []
        for path, load in layer_loads(values).items():
            event = self._update(step, path, load)
            if event is not None:
                events.append(event)
        return Observation(events)

    def _update(self, step: int, path: str, load: list[float]) -> Event | None:
        o = self.options
        layer = self.layers.get(path)
        if layer is None or len(layer.last) != len(load):
            layer = self.layers[path] = _Layer([step] * len(load), [0] * len(load))
        for e, x in enumerate(load):
            if x > 0:
                layer.last[e], layer.empty[e] = step, 0
                layer.dead.discard(e)
            else:
                layer.empty[e] += 1
        dead = {
            e for e in range(len(load)) if step - layer.last[e] >= o.window and layer.empty[e] >= o.min_values
        }
        new = sorted(dead - layer.dead)
        layer.dead |= dead
        if not new:
            return None
        return self._event(step, path, new, len(layer.dead), len(load), max(layer.last[e] for e in new))

    def _event(self, step: int, path: str, new: list[int], dead: int, n: int, since: int) -> Event:
        o = self.options
        which = ", ".join(str(e) for e in new)
        return Event(
            step,
            self.kind,
            path,
            float(dead),
            0.0,
            f"dead experts in {path}: expert{'s' if len(new) > 1 else ''} {which} got no token in the last "
            f"{step - since} steps (every sampled step since step {since}; dead after {o.window}) — "
            f"{dead} of {n} experts dead",
            details={
                "layer": path,
                "module": path,
                "experts": new,
                "dead": dead,
                "n_experts": n,
                "since": since,
            },
        )

    def rewind(self, step: int) -> None:
        """A rollback restored the router: count every expert afresh from the next measured step."""
        self.layers = {}

    def state_dict(self) -> dict[str, Any]:
        """Per layer: last fed step, empty sampled steps since, and the experts reported dead."""
        return {k: {"last": s.last, "empty": s.empty, "dead": sorted(s.dead)} for k, s in self.layers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""
        self.layers = {
            k: _Layer([int(v) for v in s["last"]], [int(v) for v in s["empty"]], {int(e) for e in s["dead"]})
            for k, s in state.items()
        }
