"""A run's events as incidents for `stabkit report`: one line per incident (the events of one cause,
grouped by the Monitor: `stabkit.incidents`), its events under it on request, then the advice.

Runs when `stabkit report` prints "events and advice". A log written before incidents existed (no
``incident`` rows) is listed event by event, as `report.events_text` does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ....sinks import LOG_NAME
from .report import Progress, event_log, events_text, group_events, read_log
from .summary import Summary


def rows_of(
    result: dict[str, Any], progress: Progress | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A variant's event rows and its incidents (the last row of each id, by first step): from its
    ``stabkit.jsonl`` (a recipe's variant) or from what `report.load_run` kept (a monitored run)."""
    log = event_log(result)
    if log is not None:
        rows = read_log(log, progress)
        events = [r for r in rows if r.get("type") == "event"]
        incident_rows = [r for r in rows if r.get("type") == "incident"]
    else:
        events = list(result.get("event_list", []))
        incident_rows = list(result.get("incident_list", []))
    last = {r.get("id"): r for r in incident_rows}
    return events, sorted(last.values(), key=lambda r: (r.get("first_step", 0), str(r.get("id"))))


def event_line(event: dict[str, Any], steps: str | None = None) -> str:
    """``step 30: [spike] loss: <message>``."""
    where = steps or f"step {event.get('step')}"
    return f"{where}: [{event.get('kind')}] {event.get('where')}: {event.get('message', '')}"


def incidents_text(
    summary: Summary, limit: int = 20, members: bool = False, progress: Progress | None = None
) -> str:
    """Per variant: its incidents, one line each with their severity (at most `limit`), each one's
    events indented under it when `members` (its rescues always: what stabkit changed in the run); events in no incident; the distinct advice. A variant
    whose log holds no incidents is listed event by event (`events_text`)."""
    lines = []
    for name, result in summary.variants.items():
        if progress is not None:
            progress.begin(name)
        events, incidents = rows_of(result, progress)
        if not incidents:  # the events as read (a "logged" result's events are not read again)
            read = {**result, "status": "logged", "event_list": events}
            lines.append(events_text(Summary(kind=summary.kind, variants={name: read}), limit))
            continue
        lines.append(f"{name}: {len(events)} event(s) in {len(incidents)} incident(s)")
        for incident in incidents[:limit]:
            lines.append(f"    {incident.get('severity', 'warning'):<8} {incident.get('headline', '')}")
            mine = [e for e in events if (e.get("details") or {}).get("incident") == incident.get("id")]
            shown = mine if members else [e for e in mine if e.get("kind") == "rescue"]  # what stabkit did
            lines.extend(f"        {event_line(e)}" for e in shown)
        if len(incidents) > limit:
            where = Path(result.get("logdir", "")) / LOG_NAME
            lines.append(f"    ... {len(incidents) - limit} more incident(s) in {where}")
        filed = {i.get("id") for i in incidents}
        loose = [e for e in events if (e.get("details") or {}).get("incident") not in filed]
        for first, last, count in group_events(loose)[:limit]:
            steps = None if count == 1 else f"steps {first.get('step')}-{last.get('step')} (x{count})"
            lines.append(f"    {event_line(first, steps)}")
        if not members and len(events) > len(incidents):
            lines.append("    (--members lists each incident's events)")
        advice = dict.fromkeys(e.get("advice", "") for e in events if e.get("advice"))
        lines.extend(f"    advice: {a}" for a in advice)
    return "\n".join(lines)
