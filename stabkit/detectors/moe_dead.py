"""The 'dead_experts' kind: experts of a mixture-of-experts layer that stop getting tokens, and stay so.

Read from the MoE probe's per-expert token counts ``moe/<layer>/load[e]`` (sampled steps; summed over
micro-batches and ranks). An expert is dead when no sampled step of the last `window` training steps
gave it a token — the definition of the probe's ``moe/<layer>/dead_experts`` (NeMo Automodel's
dead-expert count) — and at least `min_values` sampled steps saw it so (sampled every 100 steps, a
100-step window holds one, and one batch without a token is chance for a rarely chosen expert). An
expert never routed since attach counts from the first step the layer was measured.

One event per layer each time its set of dead experts gains members, naming the layer and the experts
newly dead (an expert that gets a token again leaves the set, and is reported again if it dies again);
``details["since"]`` is the last step any of them had a token. Graded by how much of the layer is lost
and for how long:

- a note ('info') for a dead expert while the layer's dead experts are fewer than `warn_share` of E:
  a rarely chosen expert of a small run can go 100–230 steps without a token and come back (tiny HF
  Mixtral, top-2 of 8, 512 choices a step, balancing loss 1e-2..5e-2: one such expert per run, early,
  never two at once);
- a warning once the dead experts are `warn_share` (a quarter) of the layer's experts or more, or an
  expert reported dead is still dead `warn_steps` (500) after its last token: an expert without tokens
  gets no gradient through the router's choice, and the Switch / GShard balancing loss gives it none
  either (its gradient on an expert's probability is proportional to that expert's load, zero here).

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
from .base import DetectorContext, Observation
from .moe_loads import ExpertLoadDetector, layer_loads


@dataclass(frozen=True)
class DeadOptions:
    """``DetectConfig.options["dead_experts"]``."""

    window: int = field(default=100, metadata=bounds(lo=1))
    """Training steps without a token after which an expert is dead (the MoE probe's window)."""
    min_values: int = field(default=5, metadata=bounds(lo=1))
    """... seen so in at least this many sampled steps."""
    warn_share: float = field(default=0.25, metadata=bounds(lo=0, hi=1, lo_open=True))
    """Dead experts of a layer at this share of its experts or more: a warning (fewer: a note)."""
    warn_steps: int = field(default=500, metadata=bounds(lo=1))
    """An expert still dead this many steps after its last token: a warning (once per death)."""


@dataclass
class _Layer:
    last: list[int]
    """Per expert, the last step it had a token (the layer's first measured step when it never had)."""
    empty: list[int]
    """Per expert, sampled steps without a token since `last`."""
    dead: set[int] = field(default_factory=set)
    """Experts reported dead and not fed since."""
    warned: set[int] = field(default_factory=set)
    """Experts of `dead` whose death was reported as a warning."""


@DETECTORS.register
class DeadExpertsDetector(ExpertLoadDetector):
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
                layer.warned.discard(e)
            else:
                layer.empty[e] += 1
        dead = {
            e for e in range(len(load)) if step - layer.last[e] >= o.window and layer.empty[e] >= o.min_values
        }
        new = sorted(dead - layer.dead)
        layer.dead |= dead
        many = len(layer.dead) >= o.warn_share * len(load)
        held = sorted(e for e in layer.dead - layer.warned if step - layer.last[e] >= o.warn_steps)
        if many:
            held = sorted(layer.dead - layer.warned)
        if not new and not held:
            return None
        severity = "warning" if many or held else "info"
        named = sorted(set(new) | set(held)) if severity == "warning" else new
        if severity == "warning":
            layer.warned |= layer.dead if many else set(held)
        return self._event(step, path, named, layer, len(load), severity, many)

    def _event(
        self, step: int, path: str, named: list[int], layer: _Layer, n: int, severity: str, many: bool
    ) -> Event:
        o = self.options
        since = max(layer.last[e] for e in named)
        dead = len(layer.dead)
        which = ", ".join(str(e) for e in named)
        if severity == "info":
            why = f"a note: a warning at {o.warn_share:.0%} of the experts or {o.warn_steps} steps dead"
        elif many:
            why = f"at least {o.warn_share:.0%} of the layer's experts"
        else:
            why = f"dead {step - since} steps, past {o.warn_steps}"
        return Event(
            step,
            self.kind,
            path,
            float(dead),
            0.0,
            f"dead experts in {path}: expert{'s' if len(named) > 1 else ''} {which} got no token since step "
            f"{since} (no sampled step for {step - since} steps; dead after {o.window}) — {dead} of {n} "
            f"experts dead ({why})",
            details={
                "layer": path,
                "module": path,
                "experts": named,
                "dead": dead,
                "n_experts": n,
                "since": since,
            },
            severity=severity,
        )

    def rewind(self, step: int) -> None:
        """A rollback restored the router: count every expert afresh from the next measured step."""
        self.layers = {}

    def state_dict(self) -> dict[str, Any]:
        """Per layer: last fed step, empty sampled steps since, the experts reported dead and warned of."""
        return {
            k: {"last": s.last, "empty": s.empty, "dead": sorted(s.dead), "warned": sorted(s.warned)}
            for k, s in self.layers.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""
        self.layers = {
            k: _Layer(
                [int(v) for v in s["last"]],
                [int(v) for v in s["empty"]],
                {int(e) for e in s["dead"]},
                {int(e) for e in s.get("warned", ())},
            )
            for k, s in state.items()
        }
