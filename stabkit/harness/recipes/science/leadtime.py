"""How early stabkit warns: lead times of the detectors' first event before a run is lost, and false
alarms on runs that are fine. Plain computation over recorded results (no torch): the seeds sweep
(`stabkit.harness.recipes.seeds`) calls it after each recipe's runs, and tests call it on event logs
with known answers.

Definitions (per run; steps are 0-based optimizer steps, as the monitor numbers its events):

- **lost**: the first step whose training loss is not finite; else, for a mixture of experts, the
  first step a layer's router collapsed (``collapse_step``, `stabkit.harness.recipes.results.moe_load`:
  the loss does not show a collapse, so the router's load says when the run went wrong); else, for a
  run that ends at or above
  the bigram level (``val_loss >= bigram_loss``, the CPU proxy's "diverged"), a point of its
  held-out curve (``val_curve``: ``[steps done, loss]``; steps done ``n`` means the loss after step
  ``n - 1``):
  - a run that once got below the bigram level: the first point after its best from which every
    later point is at or above it (it climbed back and never came down again);
  - a run that never got below it: the first point at which its reference run (same seed, a safe
    setting) was below it — where a healthy run had learned past the bigram model and this one had
    not; without a reference (or one that never got there either), its best point.
  A run that ends below the bigram level with finite losses is not lost.
- **warning**: the first event of a detector (a kind in `DETECTOR_KINDS`; an action's own events,
  e.g. ``rescue``, are not warnings) of severity 'warning' or 'critical' (a note, 'info', is not).
- **lead time**: lost step − warning step. Warned in time when the lead time is ≥ 0 (an event on the
  very step that produced the first NaN counts: the run stopped there, not a step later).
- **false alarm**: any detector warning on a reference run (a safe setting that should be quiet).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ....events import severity_rank
from ....plugins import DETECTORS


def detector_kinds() -> frozenset[str]:
    """Event kinds that are warnings: the registered detectors' names (plug-ins included)."""
    return frozenset(DETECTORS.names())


def lost_step(result: dict[str, Any], reference: dict[str, Any] | None = None) -> int | None:
    """The step at which the run in `result` (a worker's result) was lost, or None (see the module
    docstring). Needs ``first_nonfinite_step``, ``val_loss``, ``bigram_loss`` and ``val_curve``;
    `reference` is the same seed's reference run (its ``val_curve``), when the recipe has one."""
    nonfinite = result.get("first_nonfinite_step", math.nan)
    if isinstance(nonfinite, (int, float)) and math.isfinite(nonfinite):
        return int(nonfinite)
    collapse = result.get("collapse_step")
    if isinstance(collapse, int | float) and math.isfinite(collapse):
        return int(collapse)
    bigram = float(result.get("bigram_loss", math.nan))
    val = float(result.get("val_loss", math.nan))
    if math.isfinite(val) and not val >= bigram:
        return None
    curve = held_out_curve(result)
    if not curve:
        return None
    best = min(range(len(curve)), key=lambda i: curve[i][1] if math.isfinite(curve[i][1]) else math.inf)
    if any(math.isfinite(v) and v < bigram for _, v in curve):
        lost = None
        for steps_done, value in reversed(curve[best:]):
            if math.isfinite(value) and value < bigram:
                break
            lost = steps_done
        return None if lost is None else max(0, lost - 1)
    due = next((s for s, v in held_out_curve(reference or {}) if math.isfinite(v) and v < bigram), None)
    if due is None:
        return max(0, curve[best][0] - 1)
    at = next((s for s, _ in curve if s >= due), curve[-1][0])
    return max(0, at - 1)


def held_out_curve(result: dict[str, Any]) -> list[tuple[int, float]]:
    """``val_curve`` as (steps done, loss) pairs."""
    return [(int(s), float(v)) for s, v in result.get("val_curve") or []]


def first_warning(
    events: Iterable[dict[str, Any]], kinds: frozenset[str] | None = None
) -> dict[str, Any] | None:
    """The first event of a detector (in step order) of severity 'warning' or above (a note is not a
    warning; an event logged before severities counts as one), or None."""
    allowed = detector_kinds() if kinds is None else kinds
    warnings = [
        e
        for e in events
        if e.get("kind") in allowed and severity_rank(str(e.get("severity", "warning"))) >= 1
    ]
    return min(warnings, key=lambda e: int(e["step"])) if warnings else None


@dataclass
class RunLead:
    """One run's outcome for the table."""

    seed: int
    role: str
    reproduced: bool
    lost: int | None
    warned_at: int | None
    warned_by: str = ""
    events: int = 0
    """Detector warnings (severity 'warning' or above) in the run."""

    @property
    def lead(self) -> int | None:
        """Steps of warning before the run was lost (negative: warned after); None when the run was
        not lost or nothing warned."""
        if self.lost is None or self.warned_at is None:
            return None
        return self.lost - self.warned_at

    @property
    def warned_in_time(self) -> bool:
        return self.lead is not None and self.lead >= 0


def run_lead(
    seed: int,
    result: dict[str, Any],
    verdict: str = "",
    kinds: frozenset[str] | None = None,
    reference: dict[str, Any] | None = None,
) -> RunLead:
    """The `RunLead` of one variant's result (its ``event_list``, losses and curve; `reference`: the
    same seed's reference run, see `lost_step`)."""
    allowed = detector_kinds() if kinds is None else kinds
    events = [e for e in result.get("event_list") or [] if e.get("kind") in allowed]
    first = first_warning(events, allowed)
    warned = [e for e in events if severity_rank(str(e.get("severity", "warning"))) >= 1]
    counted = int(sum(result[f"events/{k}"] for k in sorted(allowed) if f"events/{k}" in result))
    # warnings only (notes are not alarms), from the kept list; when the list was cut (it keeps the
    # first 50 events), the complete counts of every severity
    count = counted if counted > len(events) else len(warned)
    return RunLead(
        seed=seed,
        role=str(result.get("role", "")),
        reproduced=verdict == "reproduced",
        lost=lost_step(result, reference),
        warned_at=None if first is None else int(first["step"]),
        warned_by="" if first is None else str(first["kind"]),
        events=count,
    )


@dataclass
class LeadRow:
    """One recipe's line of the table, over its seeds."""

    recipe: str
    seeds: int
    reproduced: int
    """Baseline runs whose verdict was "reproduced"."""
    lost: int
    """Baseline runs that were lost (non-finite, or ended at the bigram level)."""
    warned_in_time: int
    """Lost baseline runs with a detector event at or before the step they were lost."""
    warned_late: int
    """Lost baseline runs warned only after they were lost."""
    never_warned: int
    """Lost baseline runs with no detector event at all."""
    median_lead: float | None
    """Median lead time (steps) over the lost, warned baseline runs; None when there are none."""
    worst_lead: int | None
    """The smallest lead time (may be negative: late) over them."""
    warned_not_lost: int
    """Baseline runs with a warning that were not lost (e.g. damaged but above the bigram level)."""
    false_alarm_runs: int
    """Reference runs with at least one detector event."""
    reference_runs: int
    false_alarms: int
    """Detector events on the reference runs, all seeds."""
    first_kinds: list[str] = field(default_factory=list)
    """Which detector warned first, per warned baseline run."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def lead_row(recipe: str, runs: Sequence[RunLead]) -> LeadRow:
    """Aggregate one recipe's runs (baseline and reference roles; others are ignored)."""
    base = [r for r in runs if r.role == "baseline"]
    ref = [r for r in runs if r.role == "reference"]
    lost = [r for r in base if r.lost is not None]
    leads = [r.lead for r in lost if r.lead is not None]
    return LeadRow(
        recipe=recipe,
        seeds=len({r.seed for r in runs}),
        reproduced=sum(r.reproduced for r in base),
        lost=len(lost),
        warned_in_time=sum(r.warned_in_time for r in lost),
        warned_late=sum(r.lead is not None and r.lead < 0 for r in lost),
        never_warned=sum(r.warned_at is None for r in lost),
        median_lead=statistics.median(leads) if leads else None,
        worst_lead=min(leads) if leads else None,
        warned_not_lost=sum(r.lost is None and r.warned_at is not None for r in base),
        false_alarm_runs=sum(r.events > 0 for r in ref),
        reference_runs=len(ref),
        false_alarms=sum(r.events for r in ref),
        first_kinds=[r.warned_by for r in base if r.warned_by],
    )


def recipe_runs(summaries: dict[int, dict[str, Any]], kinds: frozenset[str] | None = None) -> list[RunLead]:
    """Every baseline and reference run of one recipe's per-seed summaries (``summary.json`` dicts:
    seed -> summary), with its verdict."""
    out = []
    for seed, summary in sorted(summaries.items()):
        verdicts = summary.get("verdicts", {})
        variants = summary.get("variants", {})
        reference = next((r for r in variants.values() if r.get("role") == "reference"), None)
        for name, result in variants.items():
            if result.get("role") not in ("baseline", "reference"):
                continue
            verdict = str(verdicts.get(name, {}).get("verdict", ""))
            healthy = reference if result.get("role") == "baseline" else None
            out.append(run_lead(seed, result, verdict, kinds, healthy))
    return out


def format_table(rows: Sequence[LeadRow]) -> str:
    """The table as GitHub markdown (also readable in a terminal)."""
    head = (
        "| recipe | reproduced | lost | warned in time | median lead | worst lead | late / never "
        "| false alarms (reference runs) | first warning |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        median = "–" if r.median_lead is None else f"{r.median_lead:g}"
        worst = "–" if r.worst_lead is None else f"{r.worst_lead}"
        kinds = ", ".join(sorted(set(r.first_kinds))) or "–"
        alarms = (
            f"{r.false_alarms} ({r.false_alarm_runs}/{r.reference_runs})"
            if r.reference_runs
            else "– (no reference)"
        )
        lines.append(
            f"| {r.recipe} | {r.reproduced}/{r.seeds} | {r.lost}/{r.seeds} | {r.warned_in_time}/{r.lost} "
            f"| {median} | {worst} | {r.warned_late} / {r.never_warned} "
            f"| {alarms} | {kinds} |"
        )
    return "\n".join(lines)
