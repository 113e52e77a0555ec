"""JSONL sink: one JSON object per line — metrics per step, events, notes. Each line is handed to
the operating system as it is written (a process crash loses nothing); events and `close` also sync
it to the disk.

Line kinds: ``{"type": "metrics", "step": s, "values": {...}}``, ``{"type": "event", ...Event fields}``,
``{"type": "text", "tag": ..., "text": ...}``. Non-finite numbers are written as the strings
"nan", "inf", "-inf" so every line stays valid JSON.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from ..events import Event

LOG_NAME = "stabkit.jsonl"


def json_safe(value: Any) -> Any:
    """`value` with non-finite floats as the strings "nan", "inf", "-inf" (valid JSON), recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a stabkit JSONL log back (strings 'nan'/'inf' become floats); a torn last line is skipped."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if row.get("type") == "metrics":
                row["values"] = {k: float(v) for k, v in row["values"].items()}
            rows.append(row)
    return rows


class JsonlSink:
    """Appends to `<logdir>/stabkit.jsonl`. Raises OSError when the file cannot be opened or written
    (`SinkSet` then switches it off)."""

    def __init__(self, logdir: str | Path) -> None:
        Path(logdir).mkdir(parents=True, exist_ok=True)
        self.path = Path(logdir) / LOG_NAME
        self.label = str(self.path)
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the run

    def _write(self, obj: dict[str, Any], sync: bool = False) -> None:
        if self._fh.closed:
            return
        self._fh.write(json.dumps(json_safe(obj)) + "\n")
        if sync:
            self.sync()
        else:
            self._fh.flush()

    def write_metrics(self, step: int, values: dict[str, float]) -> None:
        self._write({"type": "metrics", "step": step, "values": values})

    def write_event(self, event: Event) -> None:
        self._write({"type": "event", **event.to_dict()}, sync=True)

    def write_record(self, kind: str, data: dict[str, Any]) -> None:
        """A structured record (e.g. the audit report) as one line ``{"type": kind, ...data}``."""
        self._write({"type": kind, **data})

    def write_text(self, tag: str, text: str, step: int = 0) -> None:
        self._write({"type": "text", "tag": tag, "step": step, "text": text})

    def flush(self) -> None:
        """At each log interval: hand what was written to the operating system, so that a crash of
        the process loses nothing written so far. No ``fsync`` here: on a network filesystem one
        can take tens of milliseconds, in the training thread, every interval; an event (written
        with one) and `close` sync the file to the disk."""
        if not self._fh.closed:
            self._fh.flush()

    def sync(self) -> None:
        """Flush and ``fsync``: what was written survives a crash of the machine too."""
        if not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())

    def close(self) -> None:
        """Sync and close; the file is closed even when the sync fails (then it raises)."""
        if not self._fh.closed:
            try:
                self.sync()
            finally:
                self._fh.close()
