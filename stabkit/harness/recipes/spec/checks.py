"""`Check`: one criterion of a recipe ("max attention logit > 1e3", "val loss 0.1 below the baseline").

Parsed once when a recipe is loaded; evaluated by `stabkit.harness.recipes.verdict` after the variants ran.
A check reads one number per variant — a run quantity (`RUN_QUANTITIES`, `SWEEP_QUANTITIES`) or a
monitored metric aggregated over the logged steps — optionally relative to another variant, and
compares it with a threshold.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import RecipeError

RUN_QUANTITIES: dict[str, str] = {
    "initial_loss": "training loss at step 0 (the model at init)",
    "final_loss": "mean training loss over the last 10 % of steps",
    "best_loss": "lowest moving average of the training loss (window: 5 % of the steps)",
    "val_loss": "held-out loss at the end",
    "max_attn_logit": "max |attention logit| before any cap, over all layers and sampled steps",
    "max_attn_logit_capped": "max attention logit after a soft cap (only with a cap)",
    "max_logz": "max log Z (logsumexp of the output logits) over sampled steps",
    "mean_abs_logz": "mean |log Z| over held-out batches at the end",
    "mean_logz": "mean log Z over held-out batches at the end",
    "mean_logit": "mean output logit (over the vocabulary and positions) on held-out batches at the end",
    "diverged": "1 when the held-out loss ends non-finite or no better than a bigram model (the results table's 'above bigram'), else 0",
    "nonfinite_steps": "training steps whose loss was non-finite",
    "events": "number of detector events",
    "first_event_step": "step of the first detector event (missing when none)",
    "fault_detected": "1 when an event of the expected kind (nonfinite; spike for bad_batch) fell on the fault's steps",
    "fault_localized": "1 when such an event names the injected module, else 0",
    "fault_loss_jump": "max training loss on the fault's steps minus the median of the 20 steps before",
    "depth_grad_ratio": "last-layer grad norm at init, deepest / reference depth (see [depth])",
    "rescue_count": "rescues stabkit carried out (action 'rescue'; a rescue variant's)",
    "rescue_step": "step of the first rescue (missing when none)",
    "steps_lost": "training steps the rescues rolled back (their sum)",
    "qk_clip_heads_fraction": "qk_clip: fraction of attention heads clipped at least once",
    "qk_clip_steps": "qk_clip: steps on which some head was clipped",
    "qk_clip_quiet_step": "qk_clip: the last step with a clip (quiet after it; missing when none)",
    "qk_clip_max_after_clip": "qk_clip: largest max logit of a head at a step after its first clip (<= tau(1+eps) when the clip holds)",
    "clip_steps": "action clip: steps whose gradients (or update) it clipped",
    "max_vio": "MoE: the worst layer's MaxVio (max - mean)/mean load, averaged over the last 10 % of the run",
    "peak_max_vio": "MoE: the largest MaxVio logged (any layer, any step)",
    "busiest_share": "MoE: the worst layer's busiest-expert share of the token choices over the last 10 % of the run",
    "dead_experts": "MoE: the most experts one layer had without a token over the last 100 steps, at the end",
}
"""Per-run quantities a check can name (`events/<kind>` counts events of one kind too)."""

SWEEP_QUANTITIES: dict[str, str] = {
    "lr_sensitivity": "E over the whole LR grid of min(loss, loss at init) - best loss",
    "lr_sensitivity_high": "the same over the high end of the grid ([sweep] high)",
    "best_grid_loss": "the variant's best val loss on the LR grid",
}
"""Quantities of an LR sweep (checks under [sweep] only)."""

OPS: dict[str, Callable[[float, float], bool]] = {
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "==": operator.eq,
    "!=": operator.ne,
}
AGGS = ("max", "min", "mean", "first", "last")
VS = ("baseline", "reference", "best")
VARIANT = "variant:"
"""``vs = "variant:<name>"`` compares with the variant of that name (checked against the recipe's
variants when it loads)."""
HOW = ("diff", "ratio")
KEYS = ("metric", "op", "value", "agg", "vs", "how")


@dataclass(frozen=True)
class Check:
    """A threshold on one number of a variant."""

    metric: str
    """A run quantity (`RUN_QUANTITIES`), ``events/<kind>``, or a monitored metric name or glob
    (e.g. ``attn/*/max_logit``) aggregated with `agg`."""
    op: str
    """One of ``< <= > >= == !=``."""
    value: float
    """The threshold."""
    agg: str | None = None
    """For monitored metrics: max | min | mean | first | last over the logged steps (and matching names)."""
    vs: str | None = None
    """Compare with another variant: baseline | reference | best (lowest value over all variants)."""
    how: str = "diff"
    """With `vs`: diff (this − other) or ratio (this / other)."""

    def passes(self, measured: float) -> bool:
        """Whether `measured` satisfies the check (a NaN never does)."""
        return not math.isnan(measured) and OPS[self.op](measured, self.value)

    def describe(self) -> str:
        """Short human form, e.g. ``val_loss − baseline < -0.1``."""
        name = self.metric if self.agg is None else f"{self.agg}({self.metric})"
        if self.vs is not None:
            name = f"{name} / {self.vs}" if self.how == "ratio" else f"{name} − {self.vs}"
        return f"{name} {self.op} {self.value:g}"

    @property
    def is_history(self) -> bool:
        """True when the metric is a monitored series (needs `agg`)."""
        return "/" in self.metric and not self.metric.startswith("events/")


def parse_check(raw: Any, where: str, sweep: bool = False) -> Check:
    """Build a Check from a TOML inline table; `where` names it in errors (``criteria.reproduced[0]``)."""
    if not isinstance(raw, Mapping):
        raise RecipeError(
            where, f"must be a table like {{ metric = ..., op = ..., value = ... }}, got {raw!r}"
        )
    unknown = sorted(set(raw) - set(KEYS))
    if unknown:
        raise RecipeError(f"{where}.{unknown[0]}", f"unknown key; allowed: {', '.join(KEYS)}")
    for key in ("metric", "op", "value"):
        if key not in raw:
            raise RecipeError(f"{where}.{key}", "is required")
    metric = raw["metric"]
    known = {**RUN_QUANTITIES, **(SWEEP_QUANTITIES if sweep else {})}
    history = isinstance(metric, str) and "/" in metric and not metric.startswith("events/")
    if not isinstance(metric, str) or not (metric in known or history or metric.startswith("events/")):
        raise RecipeError(
            f"{where}.metric",
            f"unknown metric {metric!r}; allowed: {', '.join(known)}, events/<kind>, "
            "or a monitored metric like 'attn/*/max_logit' with agg",
        )
    op = raw["op"]
    if op not in OPS:
        raise RecipeError(f"{where}.op", f"must be one of {' '.join(OPS)}, got {op!r}")
    value = raw["value"]
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise RecipeError(f"{where}.value", f"must be a number, got {value!r}")
    agg = raw.get("agg")
    if history and agg not in AGGS:
        raise RecipeError(
            f"{where}.agg", f"a monitored metric needs agg, one of {', '.join(AGGS)}; got {agg!r}"
        )
    if not history and agg is not None:
        raise RecipeError(f"{where}.agg", f"only for monitored metrics (names with '/'), not {metric!r}")
    vs = raw.get("vs")
    if vs is not None and not (isinstance(vs, str) and (vs in VS or vs.startswith(VARIANT))):
        raise RecipeError(
            f"{where}.vs", f"must be one of {', '.join(VS)} or {VARIANT}<name> (a variant), got {vs!r}"
        )
    how = raw.get("how", "diff")
    if how not in HOW:
        raise RecipeError(f"{where}.how", f"must be one of {', '.join(HOW)}, got {how!r}")
    return Check(metric=metric, op=op, value=float(value), agg=agg, vs=vs, how=how)


def parse_checks(raw: Any, where: str, sweep: bool = False) -> list[Check]:
    """A TOML array of check tables."""
    if not isinstance(raw, list):
        raise RecipeError(where, f"must be an array of check tables, got {type(raw).__name__}")
    return [parse_check(item, f"{where}[{i}]", sweep) for i, item in enumerate(raw)]
