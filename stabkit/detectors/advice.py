"""The advice table: which intervention to try for which event signature, assembled from the rows
each detector plug-in declares (`Detector.advice`). Printed by `stabkit list advice`.

`advise(event, detector)` runs when an event is decided: the detector of the event's kind names the
row (`Detector.signature`), which fills `Event.advice` ("qk_norm or attn_softcap: ...") and
``details['advice' | 'interventions']``. Intervention names are registry names of
`stabkit.interventions`. Importing this module loads no torch (the detectors judge floats).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..events import Event
from ..plugins import DETECTORS


@dataclass(frozen=True)
class Advice:
    """One row of the table."""

    when: str
    """The signature in words."""
    interventions: tuple[str, ...]
    """Registry names to switch on (empty: a setting or a check, not an intervention)."""
    text: str
    """What to do, and the source."""


def advice_table() -> dict[str, Advice]:
    """Every row of every registered detector, in registry order (loads the detector classes)."""
    rows: dict[str, Advice] = {}
    for cls in DETECTORS.classes():
        rows.update(cls.advice)
    return rows


def advise(event: Event, detector: Any) -> Event:
    """Fill `event.advice` and ``details['advice', 'interventions']`` from `detector`'s row for it
    (`detector`: the instance that decided the event); returns the event."""
    key = detector.signature(event)
    row = detector.advice[key]
    event.advice = f"{' or '.join(row.interventions)}: {row.text}" if row.interventions else row.text
    event.details["advice"] = key
    event.details["interventions"] = list(row.interventions)
    return event


def describe_advice() -> str:
    """The advice table as text (what `stabkit list advice` prints)."""
    table = advice_table()
    width = max(len(k) for k in table)
    lines = [f"{'signature':<{width}}  {'interventions':<28}  when -> what to do"]
    for key, row in table.items():
        names = ", ".join(row.interventions) or "-"
        lines.append(f"{key:<{width}}  {names:<28}  {row.when} -> {row.text}")
    return "\n".join(lines)
