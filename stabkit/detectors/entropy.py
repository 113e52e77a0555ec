"""The 'attn_entropy' kind: attention entropy collapse — a head's attention turning (nearly) one-hot
fast and staying there.

Zhai et al. 2023 (σReparam) tie training instability to *entropy collapse*: the entropy of the
attention rows, Ent(A_i) = −Σ_j A_ij log A_ij, falls towards 0, and a lower bound on it falls
exponentially with the spectral norm of the logits (ViT-22B saw near-zero entropy at divergence).
Heads that learn a sharp pattern (previous token, first token) also end up with low entropy, but
slowly; a collapse is a *fall* — so the rule needs both, on ``attn/<module>/min_head_entropy``
(the attention probe's lowest per-head mean entropy, in nats, on sampled steps):

    collapse ⇔ the last `persist` values are all ≤ `low`
             and, in the `window` values before them, the series stood at ≥ `healthy`
             and fell by at least the fraction `drop` of that high point.

One event per collapse: the series re-arms once it climbs back above `healthy`. In a module with
``qk_clip`` on (seen from its ``qk_clip/<module>/max_logit`` series) a collapse is its own signature,
``attn_entropy_collapse_clipped``, whose advice names no mid-run fix: QK-Clip already holds that
module's largest logit at τ, and the collapse comes from the other logits falling away below it (a
rescue neither acts on it again nor counts it as its own failure). Runs when the
detectors consume values (see `stabkit.detectors.base`). Options: `EntropyOptions`
(``DetectConfig.options["attn_entropy"]``). Pure Python; checkpointable.
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
from .base import Detector, DetectorContext, Observation


@dataclass(frozen=True)
class EntropyOptions:
    """`DetectConfig.options["attn_entropy"]`."""

    low: float = field(default=0.3, metadata=bounds(lo=0))
    """Collapsed: min head entropy at or below this many nats (0 = one-hot; 0.3 nats ≈ 1.3 keys)."""
    healthy: float = field(default=1.0, metadata=bounds(lo=0, lo_open=True))
    """The series must have stood at or above this many nats within `window` before the fall."""
    drop: float = field(default=0.7, metadata=bounds(lo=0, hi=1, lo_open=True, hi_open=True))
    """... and fallen by at least this fraction of that high point."""
    window: int = field(default=8, metadata=bounds(lo=1))
    """Values (sampled steps) before the low run in which the fall must happen ("fast")."""
    persist: int = field(default=3, metadata=bounds(lo=1))
    """Consecutive values at or below `low` ("staying low")."""

    def __post_init__(self) -> None:
        if not self.low < self.healthy:  # the ranges are the fields' bounds; this is how two relate
            raise ValueError(f"need low < healthy, got low={self.low}, healthy={self.healthy}")


@DETECTORS.register
class EntropyCollapseDetector(Detector):
    """Entropy collapse per attention module, from ``attn/<module>/min_head_entropy``."""

    kind = "attn_entropy"
    options_class = EntropyOptions
    watches = ("attn/*/min_head_entropy", "qk_clip/*/max_logit")
    advice: ClassVar[dict[str, Advice]] = {
        "attn_entropy_collapse": Advice(
            "attention entropy collapses (a head turns one-hot fast)",
            ("qk_clip", "qk_norm", "attn_softcap"),
            "the attention logits grew: clip the heads past a threshold on their q/k weights (QK-Clip, Kimi K2), "
            "normalise q and k (ViT-22B) or soft-cap the logits at 50 (Gemma 2); "
            "σReparam bounds the logits' spectral norm (Zhai et al. 2023); lowering the LR also helps",
        ),
        "attn_entropy_collapse_clipped": Advice(
            "attention entropy collapses where QK-Clip holds the max logit at tau",
            (),
            "QK-Clip bounds the largest logit, not how far the others fall below it: a lower tau, or "
            "qk_norm from the start (it bounds every logit), keeps attention spread; lowering the LR also helps",
        ),
    }

    def __init__(self, ctx: DetectorContext) -> None:
        super().__init__(ctx)
        self.options = ctx.options(self.kind, EntropyOptions)
        self.recent: dict[str, deque[tuple[int, float]]] = {}
        """Per series, the last `window + persist` (step, value) pairs."""
        self.armed: dict[str, bool] = {}
        self.clipped: set[str] = set()
        """Attention modules with qk_clip on (their collapses: `attn_entropy_collapse_clipped`)."""

    def signature(self, event: Event) -> str:
        """attn_entropy_collapse, or attn_entropy_collapse_clipped in a module under qk_clip."""
        return "attn_entropy_collapse_clipped" if event.details.get("clipped") else "attn_entropy_collapse"

    def observe(self, step: int, values: Mapping[str, float]) -> Observation:
        """An event for each series that has just collapsed."""
        events = []
        o = self.options
        for name, x in values.items():
            if name.startswith("qk_clip/"):
                self.clipped.add(name.removeprefix("qk_clip/").removesuffix("/max_logit"))
                continue
            if x != x:  # NaN: the non-finite detector's business
                continue
            recent = self.recent.setdefault(name, deque(maxlen=o.window + o.persist))
            recent.append((step, x))
            if x >= o.healthy:
                self.armed[name] = True
            tail = [v for _, v in list(recent)[-o.persist :]]
            earlier = list(recent)[: -o.persist]
            before = [v for _, v in earlier]
            if not self.armed.get(name, True) or len(tail) < o.persist or not before:
                continue
            high = max(before)
            if max(tail) <= o.low and high >= o.healthy and x <= (1 - o.drop) * high:
                self.armed[name] = False
                since = max(s for s, v in earlier if v >= o.healthy)  # the last step still healthy
                events.append(self._event(step, name, x, high, len(before), since))
        return Observation(events)

    def _event(self, step: int, name: str, x: float, high: float, span: int, since: int) -> Event:
        module = name.removeprefix("attn/").removesuffix("/min_head_entropy")
        o = self.options
        return Event(
            step,
            self.kind,
            module,
            x,
            o.low,
            f"attention entropy collapsed in {module}: its lowest head entropy fell from {high:.3g} to "
            f"{x:.3g} nats within {span + o.persist} sampled steps and stayed ≤ {o.low:g} for {o.persist}",
            details={
                "series": name,
                "high": high,
                "low": o.low,
                "module": module,
                "since": since,
                "clipped": module in self.clipped,
            },
        )

    def rewind(self, step: int) -> None:
        """Forget the values from `step` on and arm every series again."""
        for name, recent in self.recent.items():
            kept = [(t, v) for t, v in recent if t < step]
            recent.clear()
            recent.extend(kept)
            self.armed[name] = True

    def state_dict(self) -> dict[str, Any]:
        """The recent values and arming of each series."""
        return {"recent": {k: list(v) for k, v in self.recent.items()}, "armed": dict(self.armed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""
        size = self.options.window + self.options.persist
        self.recent = {
            k: deque(((int(s), float(v)) for s, v in pairs), maxlen=size)
            for k, pairs in state.get("recent", {}).items()
        }
        self.armed = dict(state.get("armed", {}))
