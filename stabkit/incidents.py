"""Incidents: the events that share a cause, as one thing to read.

One LR blow-up makes the loss, the gradient norm and every layer's series spike within a step or
two: dozens of events, one cause. The Monitor files every event it reports into an `IncidentLog`
(at `Monitor.report`, when the event is decided): an event joins the newest incident when its step
lies within `gap` steps of that incident's steps, else it opens a new one. An incident keeps its
members, its severity (the highest of its members), the kinds involved and the member that moved
first (the earliest step, or the earliest ``details["since"]``: where a drift began). The event gets
``details["incident"]`` (the incident's id); the sinks get a ``write_record("incident", ...)`` row
each time an incident opens or changes (the last row of an id is the incident as it stands), and
the console prints one line per incident (and one more if its severity rises). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .events import Event, severity_rank

DEFAULT_GAP = 5
"""Steps between two events of one incident, at most (a blow-up's series move within a step or two;
sampled per-layer series arrive on the next sampled step)."""


@dataclass
class Incident:
    """Events of one cause: the first opened it, the others joined within `IncidentLog.gap` steps."""

    id: int
    first_step: int
    last_step: int
    severity: str
    members: list[Event] = field(default_factory=list)

    @property
    def first(self) -> Event:
        """The member that moved first: the earliest start (``details['since']`` or the step)."""
        return min(self.members, key=lambda e: (_start(e), e.step))

    @property
    def kinds(self) -> list[str]:
        """The kinds of its members, in order of first appearance."""
        return list(dict.fromkeys(e.kind for e in self.members))

    def headline(self) -> str:
        """One line: severity, steps, the first mover and how many events joined it."""
        first = self.first
        steps = (
            f"step {self.first_step}"
            if self.first_step == self.last_step
            else f"steps {self.first_step}–{self.last_step}"
        )
        more = len(self.members) - 1
        tail = f" (+{more} more event{'s' if more > 1 else ''}: {', '.join(self.kinds)})" if more else ""
        return f"incident {self.id} at {steps}: [{first.kind}] {first.where}: {first.message}{tail}"

    def to_dict(self) -> dict[str, Any]:
        """The ``incident`` record the sinks get (JSON-ready)."""
        first = self.first
        return {
            "id": self.id,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "severity": self.severity,
            "kinds": self.kinds,
            "members": len(self.members),
            "first": first.where,
            "first_kind": first.kind,
            "series": list(dict.fromkeys(e.where for e in self.members)),
            "advice": first.advice,
            "headline": self.headline(),
        }


def _start(event: Event) -> int:
    since = event.details.get("since")
    return int(since) if isinstance(since, (int, float)) and since <= event.step else event.step


class IncidentLog:
    """The incidents of one run, newest last. Called once per reported event (`file`)."""

    def __init__(self, gap: int = DEFAULT_GAP) -> None:
        if gap < 0:
            raise ValueError(f"incident gap must be >= 0 steps, got {gap}")
        self.gap = gap
        self.incidents: list[Incident] = []

    def file(self, event: Event) -> tuple[Incident, bool]:
        """Put `event` into its incident (sets ``event.details['incident']``). Returns the incident and
        whether this event changes what the console shows: it opened the incident, or raised its
        severity."""
        current = self.incidents[-1] if self.incidents else None
        if (
            current is not None
            and current.first_step - self.gap <= event.step <= current.last_step + self.gap
        ):
            current.members.append(event)
            current.first_step = min(current.first_step, event.step)
            current.last_step = max(current.last_step, event.step)
            raised = severity_rank(event.severity) > severity_rank(current.severity)
            if raised:
                current.severity = event.severity
            event.details["incident"] = current.id
            return current, raised
        incident = Incident(len(self.incidents) + 1, event.step, event.step, event.severity, [event])
        self.incidents.append(incident)
        event.details["incident"] = incident.id
        return incident, True
