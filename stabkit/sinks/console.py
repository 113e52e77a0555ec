"""Console sink: one short line per log interval and one line per event, on stderr."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from ..events import Event, severity_rank
from ..metric_names import ACT, ATTN, is_stat
from .audit_console import audit_block

HEADLINE = (
    ("loss", "loss"),
    ("grad/global_norm", "grad"),
    ("logits/logz_max", "logZmax"),
)


def summary_line(step: int, values: dict[str, float]) -> str:
    """`step 120 | loss 2.31 | grad 0.84 | act max 12.3 (blocks.1) | ...`"""
    parts = [f"step {step}"]
    for key, label in HEADLINE:
        if key in values:
            parts.append(f"{label} {values[key]:.4g}")
    acts = {k: v for k, v in values.items() if is_stat(k, ACT, "absmax")}
    if acts:
        worst = max(acts, key=lambda k: acts[k] if acts[k] == acts[k] else float("inf"))
        parts.append(f"act max {acts[worst]:.4g} ({worst[4:-7]})")
    attn = {k: v for k, v in values.items() if is_stat(k, ATTN, "max_logit")}
    if attn:
        parts.append(f"attn logit max {max(attn.values()):.4g}")
    return "[stabkit] " + " | ".join(parts)


def event_line(event: Event) -> str:
    """`[stabkit] WARNING step 80 [spike] loss: loss = 1.6 is 20× ... -> try: qk_norm (incident 2)`:
    the severity first, the advice as intervention names (the full text is in the JSONL log, in
    TensorBoard and in `stabkit list advice`), cut to one readable line."""
    names = event.details.get("interventions")
    if names:
        advice = " or ".join(names)
    else:
        advice = event.advice if len(event.advice) <= 90 else event.advice[:87].rstrip() + "..."
    tail = f" -> try: {advice}" if advice else ""
    incident = event.details.get("incident")
    where = f" (incident {incident})" if incident is not None else ""
    return f"[stabkit] {event.severity.upper()} step {event.step} [{event.kind}] {event.where}: {event.message}{tail}{where}"


class ConsoleSink:
    """Prints to `stream` (default stderr): one line per log interval, one line per incident (the
    event that opened it, and again when a member raises its severity); the other members of an
    incident are in the JSONL log and `stabkit report`."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream
        self.label = "the console (stderr)"
        self._shown: dict[Any, int] = {}
        """Incident id -> the severity rank last printed for it."""

    def _print(self, text: str) -> None:
        print(text, file=self.stream or sys.stderr, flush=True)

    def write_metrics(self, step: int, values: dict[str, float]) -> None:
        self._print(summary_line(step, values))

    def write_event(self, event: Event) -> None:
        """Print `event` when it opens an incident or raises its incident's severity."""
        incident = event.details.get("incident")
        rank = severity_rank(event.severity)
        if incident is not None:
            if incident in self._shown and self._shown[incident] >= rank:
                return
            self._shown[incident] = rank
        self._print(event_line(event))

    def write_record(self, kind: str, data: dict[str, Any]) -> None:
        """The audit at attach: its risks as a short block (`stabkit.sinks.audit_console`); other
        records are for the JSONL log."""
        if kind == "audit":
            block = audit_block(data)
            if block is not None:
                self._print(block)

    def write_text(self, tag: str, text: str, step: int = 0) -> None:
        """Texts (audit reports) are not echoed on the console."""

    def flush(self) -> None:
        (self.stream or sys.stderr).flush()

    def close(self) -> None:
        self.flush()
