"""How balanced a run's mixture-of-experts routers ended, from its monitor's history: MaxVio, the
busiest expert's share and the dead experts of the worst layer (`stabkit.moe.finish` writes them per
layer at each log interval).

Called by `stabkit.harness.recipes.results.finish` once a variant has ended; the numbers join the
variant's summary entry (`MOE_KEYS`), where checks (``{ metric = "max_vio", op = "<", value = 1 }``)
and the report read them by name. None for a model without a router.
"""

from __future__ import annotations

import math
import re
from typing import Any

MOE_KEYS = ("max_vio", "max_vio_at", "peak_max_vio", "busiest_share", "dead_experts", "collapse_step")
"""The keys `moe_quantities` returns, in order."""

TAIL = 0.1
"""Share of the run (its last logged rows) a final value is averaged over."""
COLLAPSED = 0.75
"""A layer is collapsed at a step where its MaxVio is at least this fraction of its maximum E/k − 1
(top-2 of 8: 2.25; the ``expert_collapse`` detector's level)."""
HOLD, HELD = 50, 0.8
"""A collapse counts when it holds: at least `HELD` of a layer's logged values over `HOLD` steps from its
start are collapsed (healthy runs pass through a collapse of ~10 steps early on)."""

_STAT = re.compile(r"^moe/(.+)/(max_vio|busiest_share|dead_experts)$")


def _series(history: list[tuple[int, dict[str, float]]], stat: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {}
    for step, row in history:
        for name, value in row.items():
            m = _STAT.match(name)
            if m is not None and m.group(2) == stat and math.isfinite(value):
                out.setdefault(m.group(1), []).append((step, value))
    return out


def _tail_mean(points: list[tuple[int, float]], last_step: int, span: int) -> float:
    tail = [v for s, v in points if s > last_step - span] or [points[-1][1]]
    return sum(tail) / len(tail)


def moe_quantities(
    history: list[tuple[int, dict[str, float]]], top_k: dict[str, tuple[int, int]] | None = None
) -> dict[str, Any] | None:
    """``max_vio``: the largest over layers of each layer's MaxVio averaged over the last `TAIL` of
    the run's steps (one log row, at least), at ``max_vio_at`` (the layer); ``peak_max_vio``: the
    largest MaxVio logged; ``busiest_share``: the worst layer's busiest-expert share over the same
    tail; ``dead_experts``: the most dead experts a layer had at its last logged row (experts with no
    token in the last `stabkit.moe.probe.DEAD_WINDOW` steps; 0 before a window has passed). None when
    no MoE statistic was logged. With `top_k` (layer -> (E, k), from the model map): ``collapse_step``,
    the first logged step at which a layer's MaxVio reached `COLLAPSED` of its maximum E/k − 1 and held
    there (`HOLD`, `HELD`; None: never), where the recipes' lead time counts a collapsed run as lost."""
    vio = _series(history, "max_vio")
    if not vio:
        return None
    last = max(s for points in vio.values() for s, _ in points)
    span = max(1, math.ceil(TAIL * (last + 1)))
    finals = {layer: _tail_mean(points, last, span) for layer, points in vio.items()}
    worst = max(finals, key=lambda k: finals[k])
    shares = _series(history, "busiest_share")
    dead = _series(history, "dead_experts")
    return {
        "max_vio": finals[worst],
        "max_vio_at": worst,
        "peak_max_vio": max(v for points in vio.values() for _, v in points),
        "busiest_share": max((_tail_mean(p, last, span) for p in shares.values()), default=math.nan),
        "dead_experts": max((p[-1][1] for p in dead.values()), default=0.0),
        "collapse_step": _collapse_step(vio, top_k or {}),
    }


def _collapse_step(vio: dict[str, list[tuple[int, float]]], top_k: dict[str, tuple[int, int]]) -> int | None:
    steps = []
    for layer, points in vio.items():
        if layer not in top_k:
            continue
        n, k = top_k[layer]
        level = COLLAPSED * (n / k - 1)
        last = points[-1][0]
        for start, value in points:
            if start + HOLD > last:
                break
            span = [v for s, v in points if start <= s <= start + HOLD]
            if value >= level and sum(v >= level for v in span) >= HELD * len(span):
                steps.append(start)
                break
    return min(steps) if steps else None
