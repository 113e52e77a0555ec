"""Per-layer expert loads as the MoE detectors read them: the counts ``moe/<layer>/load[e]`` of one
step's row gathered into one list per layer, and the layer's *collapse fraction*.

Runs when an MoE detector consumes a row (`stabkit.detectors.moe_collapse`, `moe_dead`). The counts
are the MoE probe's (`stabkit.moe.probe`), summed over micro-batches and ranks; the detectors take
their own ratios from them (not the probe's ``max_vio`` series, which is added only at the log
interval), so they judge alike when decided every step.

Collapse fraction of a layer with E experts and top-k routing: with a token's k choices on k distinct
experts the busiest expert's share of the step's choices is at most 1/k, and 1/E when balanced, so

    collapse = (share − 1/E) / (1/k − 1/E) = MaxVio / (E/k − 1)       (0: balanced, 1: total collapse)

since MaxVio = (max − mean)/mean = E·share − 1. A threshold on it means the same for top-1 of 8 and
top-8 of 64 (an absolute MaxVio threshold would not: its maximum is E/k − 1).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..moe.finish import LOAD
from .base import Detector


def is_load(name: str) -> bool:
    """True when `name` is an expert's token count ``moe/<layer>/load[e]``."""
    return LOAD.match(name) is not None


def layer_loads(values: Mapping[str, float]) -> dict[str, list[float]]:
    """{layer path: tokens per expert, in expert order} from the load counts among `values` (an
    expert missing from the row counts 0; non-finite counts leave the layer out)."""
    found: dict[str, dict[int, float]] = {}
    for name, value in values.items():
        m = LOAD.match(name)
        if m is not None:
            found.setdefault(m.group(1).removeprefix("moe/"), {})[int(m.group(2))] = value
    out: dict[str, list[float]] = {}
    for layer, by_expert in found.items():
        load = [by_expert.get(e, 0.0) for e in range(max(by_expert) + 1)]
        if all(x == x and abs(x) != float("inf") for x in load):
            out[layer] = load
    return out


def collapse_fraction(load: list[float], top_k: int) -> float | None:
    """MaxVio over its maximum for top-`top_k` routing of ``len(load)`` experts (module docstring);
    None when no token was routed or k ≥ E (nothing to collapse)."""
    n, total = len(load), sum(load)
    if total <= 0 or top_k >= n:
        return None
    share = max(load) / total
    return (share - 1.0 / n) / (1.0 / top_k - 1.0 / n)


class ExpertLoadDetector(Detector):
    """Base of the detectors that judge the per-expert token counts: they want exactly those series."""

    def wants(self, name: str) -> bool:
        """The per-expert token counts (the names hold '[', which globs read as a class)."""
        hit = self._wants.get(name)
        if hit is None:
            hit = self._wants[name] = is_load(name)
        return hit
