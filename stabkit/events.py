"""`Event`: one thing a detector noticed (a spike, a non-finite value, a drift)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES: tuple[str, ...] = ("info", "warning", "critical")
"""Event severities, mildest first."""


def severity_rank(severity: str) -> int:
    """0 for 'info', 1 for 'warning', 2 for 'critical' (an unknown name ranks as 'warning')."""
    return SEVERITIES.index(severity) if severity in SEVERITIES else 1


@dataclass
class Event:
    """A detector's finding at one step, with where it happened and what to switch on."""

    step: int
    """Training step (0-based count of completed `Monitor.step` calls) the event belongs to."""
    kind: str
    """The detector that decided it (`stabkit.plugins.DETECTORS`): 'nonfinite', 'spike', 'drift', 'amp',
    'attn_entropy', or a plug-in's kind."""
    where: str
    """Metric name or module path that caused it."""
    value: float
    """The observed value."""
    threshold: float
    """The threshold it crossed."""
    message: str
    """One human sentence."""
    advice: str = ""
    """Suggested intervention or setting (registry names)."""
    details: dict[str, Any] = field(default_factory=dict)
    """Extra structured facts (pass, tensor, series, the evidence: values, window, threshold...)."""
    severity: str = "warning"
    """How much it matters (`SEVERITIES`): 'info' (a note: worth knowing, a healthy run may carry it),
    'warning' (the run is at risk: what a healthy run never raises) or 'critical' (the run is being
    lost: non-finite values, a gross jump). Actions act on 'warning' and above by default
    (`DetectConfig.act_on`)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)

    def __str__(self) -> str:
        tail = f" -> try: {self.advice}" if self.advice else ""
        return f"[{self.kind}] step {self.step} at {self.where}: {self.message}{tail}"


class InstabilityError(RuntimeError):
    """Raised by the `raise` action; carries the event that triggered it."""

    def __init__(self, event: Event) -> None:
        super().__init__(str(event))
        self.event = event
