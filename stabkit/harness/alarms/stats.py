"""The alarm benchmark's statistics, per detector kind: plain computation over recorded events (no
torch), called once after the corpus and the recipes have run, and by tests on hand-made event lists.

Definitions (events are dicts with at least ``step``, ``kind`` and ``severity``):

- **warning**: an event of severity ``warning`` or ``critical`` (`is_warning`); ``info`` events are
  **notes** (a healthy run may carry them).
- **false alarm**: a warning on a healthy corpus run without planted spikes. Rate: false alarms per
  1000 optimizer steps of those runs.
- **planted spike found**: a warning whose step lies in ``[s, s + SPIKE_TOLERANCE]`` for a spike
  planted at step ``s``; the first such event (lowest step, then list order) names the kind that found it.
- **lost run warned**: for a recipe's lost baseline run (`stabkit.harness.recipes.science.leadtime.lost_step`),
  its first warning (any kind); lead time = lost step − warning step, warned in time when ≥ 0.
  Per kind, the kind's own first warning on that run gives its lead time.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ...events import severity_rank

SPIKE_TOLERANCE = 2
"""Steps after a planted spike within which a warning counts as finding it (the spike's own step included)."""

ALL = "all"
"""The row for every kind together."""


def is_warning(event: dict[str, Any]) -> bool:
    """Severity ``warning`` or above (an event without a severity counts as a warning)."""
    return severity_rank(str(event.get("severity", "warning"))) >= 1


def spike_finder(
    events: Iterable[dict[str, Any]], step: int, tolerance: int = SPIKE_TOLERANCE
) -> dict[str, Any] | None:
    """The first warning in ``[step, step + tolerance]``, or None when the spike went unseen."""
    hits = [e for e in events if is_warning(e) and step <= int(e["step"]) <= step + tolerance]
    return min(hits, key=lambda e: int(e["step"])) if hits else None


@dataclass
class KindRow:
    """One detector kind's line of the table (or `ALL`)."""

    kind: str
    false_alarms: int = 0
    """Warnings on healthy runs."""
    false_alarm_runs: int = 0
    """Healthy runs with at least one warning of this kind."""
    notes: int = 0
    """``info`` events on healthy runs."""
    per_1000_steps: float = 0.0
    """False alarms per 1000 healthy optimizer steps."""
    spikes_found: int = 0
    """Planted spikes this kind found first (`ALL`: found at all)."""
    spikes_planted: int = 0
    lost_warned: int = 0
    """Lost recipe runs this kind warned in time (`ALL`: any kind)."""
    lost_runs: int = 0
    median_lead: float | None = None
    worst_lead: int | None = None
    leads: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class LostRun:
    """A recipe's lost baseline run: where it was lost and its events."""

    label: str
    lost: int
    events: tuple[dict[str, Any], ...]


def first_warnings(events: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Each kind's first warning step."""
    first: dict[str, int] = {}
    for e in events:
        if is_warning(e):
            k, s = str(e["kind"]), int(e["step"])
            first[k] = min(s, first.get(k, s))
    return first


def table(
    healthy: Sequence[dict[str, Any]],
    planted: Sequence[dict[str, Any]] = (),
    lost: Sequence[LostRun] = (),
    tolerance: int = SPIKE_TOLERANCE,
) -> list[KindRow]:
    """Rows per kind (sorted, `ALL` first). `healthy` / `planted`: corpus outcomes (``events``,
    ``steps``; planted ones also ``spikes`` as [step, factor]); `lost`: the recipes' lost runs."""
    rows: dict[str, KindRow] = {ALL: KindRow(ALL)}

    def row(kind: str) -> KindRow:
        return rows.setdefault(kind, KindRow(kind))

    steps = sum(int(r.get("steps") or 0) for r in healthy)
    for r in healthy:
        seen: set[str] = set()
        for e in r.get("events", []):
            k = str(e["kind"])
            if is_warning(e):
                row(k).false_alarms += 1
                rows[ALL].false_alarms += 1
                seen.add(k)
            else:
                row(k).notes += 1
                rows[ALL].notes += 1
        for k in seen:
            row(k).false_alarm_runs += 1
        rows[ALL].false_alarm_runs += bool(seen)
    for r in planted:
        for s, _factor in r.get("spikes", []):
            rows[ALL].spikes_planted += 1
            hit = spike_finder(r.get("events", []), int(s), tolerance)
            if hit is not None:
                rows[ALL].spikes_found += 1
                row(str(hit["kind"])).spikes_found += 1
    for run in lost:
        rows[ALL].lost_runs += 1
        first = first_warnings(run.events)
        if first:
            lead = run.lost - min(first.values())
            rows[ALL].leads.append(lead)
            rows[ALL].lost_warned += lead >= 0
        for k, s in first.items():
            row(k).leads.append(run.lost - s)
            row(k).lost_warned += run.lost - s >= 0
    for kr in rows.values():
        kr.per_1000_steps = 1000 * kr.false_alarms / steps if steps else 0.0
        if kr.kind != ALL:
            kr.spikes_planted = rows[ALL].spikes_planted
            kr.lost_runs = rows[ALL].lost_runs
        if kr.leads:
            kr.median_lead = float(statistics.median(kr.leads))
            kr.worst_lead = min(kr.leads)
    return [rows[ALL], *(rows[k] for k in sorted(rows) if k != ALL)]


def format_rows(rows: Sequence[KindRow]) -> str:
    """The table as GitHub markdown (also readable in a terminal)."""
    lines = [
        "| detector | false alarms (runs) | per 1000 steps | notes | planted spikes found | lost runs warned in time | median lead | worst lead |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        med = "–" if r.median_lead is None else f"{r.median_lead:g}"
        worst = "–" if r.worst_lead is None else str(r.worst_lead)
        lines.append(
            f"| {r.kind} | {r.false_alarms} ({r.false_alarm_runs}) | {r.per_1000_steps:.2f} | {r.notes} "
            f"| {r.spikes_found}/{r.spikes_planted} | {r.lost_warned}/{r.lost_runs} | {med} | {worst} |"
        )
    return "\n".join(lines)
