"""What a variant's run amounts to (`Measures`): its table quantities from the losses, the monitor's
history and events, and whether the detectors caught the recipe's fault.

Called by the worker once a variant has ended (done, failed or interrupted), on every rank of a
data-parallel job alike (the monitor's history and the recorded losses are the agreed values).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from ....monitor import Monitor
from ..run.job import Job
from ..spec.rescue import rescue_quantities
from ..spec.schema import FaultSpec
from .clipping import clip_quantities
from .measures import aggregate, best_smoothed, bigram_loss, monitored, tail_mean
from .moe_load import moe_quantities
from .run_result import Measures, RunResult


def finish(
    job: Job, result: RunResult, losses: list[float], mon: Monitor | None, fault_module: str | None = None
) -> Measures:
    """Quantities of a (possibly partial) run from its losses, monitor history and events
    (`fault_module`: where the recipe's nan / inf fault was injected in this model, when not the
    path the recipe names, `stabkit.harness.recipes.faults.fault_module`)."""
    recipe = job.recipe
    fault = (
        replace(recipe.fault, module=fault_module)
        if recipe.fault is not None and fault_module
        else recipe.fault
    )
    history = list(mon.history) if mon is not None else []
    events = [e.to_dict() for e in mon.events] if mon is not None else []
    top = monitored(history)
    bigram = bigram_loss(recipe.data)
    val = result.val_loss
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    rescue = None
    if job.recipe.variant(job.variant).role == "rescue" or "rescue" in kinds:
        rescue = rescue_quantities(events)
    return Measures(
        max_attn_logit=top["max_attn_logit"],
        max_attn_logit_at=top["max_attn_logit_at"],
        max_attn_logit_capped=top["max_attn_logit_capped"],
        max_logz=top["max_logz"],
        initial_loss=losses[0] if losses else math.nan,
        final_loss=tail_mean(losses),
        best_loss=best_smoothed(losses),
        nonfinite_steps=sum(1 for v in losses if not math.isfinite(v)),
        first_nonfinite_step=next((i for i, v in enumerate(losses) if not math.isfinite(v)), math.nan),
        bigram_loss=bigram,
        diverged=float(not math.isfinite(val) or val >= bigram) if result.finished else math.nan,
        events=len(events),
        event_counts=kinds,
        event_list=events[:50],
        first_event_step=events[0]["step"] if events else math.nan,
        first_event_kind=events[0]["kind"] if events else "",
        aggregates={
            f"{agg}({pattern})": aggregate(history, pattern, agg)[0] for agg, pattern in job.history_checks
        },
        rescue=rescue,
        fault=fault_quantities(fault, events, losses) if fault is not None else None,
        depth_grad_ratio=result.depth["depth_grad_ratio"] if result.depth is not None else None,
        clipping=clip_quantities(history, result.steps),
        moe=moe_quantities(history, _moe_layers(mon)),
    )


def _moe_layers(mon: Monitor | None) -> dict[str, tuple[int, int]]:
    """MoE layer path -> (E, k), from the monitor's model map (empty without one)."""
    if mon is None:
        return {}
    try:
        layers = mon.model_map.moe
    except RuntimeError:  # no map yet (discovery waited for a forward that never came)
        return {}
    return {m.path: (m.n_experts, m.top_k) for m in layers}


def fault_quantities(fault: FaultSpec, events: list[dict[str, Any]], losses: list[float]) -> dict[str, float]:
    """Whether the detectors saw the injected fault (an event of the expected kind on its steps or
    the next), named its module (nan / inf), and how far the loss jumped on its steps (nats above
    the median of the 20 steps before)."""
    kind = "spike" if fault.kind == "bad_batch" else "nonfinite"
    window = [e for e in events if e["kind"] == kind and fault.step <= e["step"] <= fault.step + fault.length]
    before = sorted(v for v in losses[max(0, fault.step - 20) : fault.step] if math.isfinite(v))
    during = losses[fault.step : fault.step + fault.length]
    jump = math.nan
    if before and during:
        jump = (
            math.inf if any(not math.isfinite(v) for v in during) else max(during) - before[len(before) // 2]
        )
    return {
        "fault_step": float(fault.step),
        "fault_detected": float(bool(window)),
        "fault_localized": float(any(fault.module in str(e.get("where", "")) for e in window)),
        "fault_loss_jump": jump,
    }
