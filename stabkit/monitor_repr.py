"""What a Monitor shows when printed or left as a notebook cell's value: `Monitor.__repr__` (text) and
`Monitor._repr_html_` (a small table), both from one `summary` of the run's state.

Runs only when the user asks for it (printing, a notebook cell). The newest values come from
`Monitor.metrics`, which copies the steps not yet written out to the host — the one sync this costs.
"""

from __future__ import annotations

import html
from collections import Counter
from typing import Any

from .events import Event, severity_rank

RECENT = 5
"""Events listed (the newest)."""
HEADLINE = (("loss", "loss"), ("grad/global_norm", "grad norm"), ("logits/logz_max", "log Z max"))


def state(mon: Any) -> str:
    """'attached', 'detached', 'waiting for the first forward' or 'disabled (STABKIT_DISABLE)'."""
    if getattr(mon, "watches_nothing", False):  # a `stabkit.disabled.DisabledMonitor`
        return "disabled (STABKIT_DISABLE)"
    if mon._detached:
        return "detached"
    if mon._model_map is None:
        return "waiting for the first forward (discovery)"
    return "attached"


def summary(mon: Any) -> list[tuple[str, str]]:
    """(label, text) rows: state, step, logdir, model, what is watched, newest values, events."""
    cfg = mon.config
    rows = [("state", state(mon)), ("step", str(mon.global_step))]
    rows.append(("logdir", str(mon.logdir) if mon.logdir is not None else "none (console only)"))
    mmap = mon._model_map
    model = type(mon.model).__name__
    if mmap is not None:
        model += f" ({mmap.family}, {len(mmap.block_paths)} blocks)"
    rows.append(("model", model))
    if state(mon).startswith("disabled"):
        return rows
    attn = f", attention every {cfg.attention_every}" if cfg.attention_every != cfg.every else ""
    rows.append(
        (
            "watching",
            f"{', '.join(sorted(cfg.families))}; per-layer every {cfg.every}{attn}; "
            f"written every {cfg.log_every}",
        )
    )
    detectors = mon.detectors
    if detectors is not None and not detectors.removed:
        rows.append(("detectors", ", ".join(detectors.judge.kinds()) or "none"))
    if mon.interventions is not None:
        rows.append(("interventions", ", ".join(mon.interventions.names)))
    metrics = mon.metrics  # the newest values: a host copy of the steps not yet written out
    newest = [f"{label} {metrics[key]:.4g}" for key, label in HEADLINE if key in metrics]
    if newest:
        rows.append(("newest", ", ".join(newest)))
    rows.append(("events", event_counts(mon.events)))
    return rows


def event_counts(events: list[Event]) -> str:
    """'3 (1 critical, 2 warning)' or 'none'."""
    if not events:
        return "none"
    counts = Counter(e.severity for e in events)
    parts = [f"{counts[s]} {s}" for s in sorted(counts, key=severity_rank, reverse=True)]
    return f"{len(events)} ({', '.join(parts)})"


def recent(events: list[Event]) -> list[Event]:
    """The newest `RECENT` events, oldest first."""
    return events[-RECENT:]


def event_line(event: Event) -> str:
    """``step 12  warning   [spike] loss: message -> try: advice``"""
    tail = f" -> try: {event.advice}" if event.advice else ""
    return f"step {event.step:<6} {event.severity:<8} [{event.kind}] {event.where}: {event.message}{tail}"


def text(mon: Any) -> str:
    """`Monitor.__repr__`: one line per summary row, then the newest events."""
    rows = summary(mon)
    width = max(len(label) for label, _ in rows)
    lines = ["stabkit.Monitor", *(f"  {label:<{width}}  {value}" for label, value in rows)]
    lines += [f"    {event_line(e)}" for e in recent(mon.events)]
    return "\n".join(lines)


_COLOUR = {"info": "#1f6feb", "warning": "#b08800", "critical": "#cf222e"}


def to_html(mon: Any) -> str:
    """`Monitor._repr_html_`: the summary as a table, then the newest events with their severity."""
    esc = html.escape
    cells = "".join(
        f"<tr><th style='text-align:left;padding-right:1em'>{esc(k)}</th><td style='text-align:left'>{esc(v)}</td></tr>"
        for k, v in summary(mon)
    )
    out = f"<div><b>stabkit.Monitor</b><table>{cells}</table>"
    events = recent(mon.events)
    if events:
        items = "".join(
            f"<li><span style='color:{_COLOUR.get(e.severity, '#000')};font-weight:bold'>{esc(e.severity)}</span> "
            f"step {e.step} [{esc(e.kind)}] <code>{esc(e.where)}</code>: {esc(e.message)}"
            + (f" &rarr; try: <code>{esc(e.advice)}</code>" if e.advice else "")
            + "</li>"
            for e in events
        )
        out += f"<p>newest events:</p><ul>{items}</ul>"
    return out + "</div>"
