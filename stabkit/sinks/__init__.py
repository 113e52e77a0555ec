"""Sinks write metrics and events out (TensorBoard, JSONL, console); they only read, never compute."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from ..events import Event
from .console import ConsoleSink, summary_line
from .jsonl import LOG_NAME, JsonlSink, read_jsonl
from .tensorboard import TensorBoardSink, custom_scalar_layout


class Sink(Protocol):
    """What the Monitor calls on each sink."""

    def write_metrics(self, step: int, values: dict[str, float]) -> None: ...
    def write_event(self, event: Event) -> None: ...
    def write_text(self, tag: str, text: str, step: int = 0) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class SinkSet:
    """Fans out to every sink; the console only sees the newest step of each batch of rows."""

    def __init__(self, logdir: str | Path | None, tensorboard: bool, jsonl: bool, console: bool) -> None:
        self.files: list[Sink] = []
        self.console: ConsoleSink | None = ConsoleSink() if console else None
        if logdir is not None:
            if tensorboard:
                self.files.append(TensorBoardSink(logdir))
            if jsonl:
                self.files.append(JsonlSink(logdir))
        self.closed = False

    def write_rows(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        """Write drained rows (step, values) to the file sinks, the newest to the console; then flush."""
        if self.closed or not rows:
            return
        for step, values in rows:
            for sink in self.files:
                sink.write_metrics(step, values)
        if self.console is not None:
            self.console.write_metrics(*rows[-1])
        for sink in self.files:
            sink.flush()

    def write_event(self, event: Event) -> None:
        if self.closed:
            return
        for sink in self._all():
            sink.write_event(event)

    def write_record(self, kind: str, data: dict[str, Any]) -> None:
        """Structured data for the JSONL log only."""
        for sink in self.files:
            if isinstance(sink, JsonlSink) and not self.closed:
                sink.write_record(kind, data)

    def write_text(self, tag: str, text: str, step: int = 0) -> None:
        if self.closed:
            return
        for sink in self._all():
            sink.write_text(tag, text, step)

    def flush(self) -> None:
        for sink in self._all():
            sink.flush()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for sink in self._all():
            sink.close()

    def _all(self) -> list[Sink]:
        return [*self.files, *([self.console] if self.console is not None else [])]


__all__ = [
    "LOG_NAME",
    "ConsoleSink",
    "JsonlSink",
    "Sink",
    "SinkSet",
    "TensorBoardSink",
    "custom_scalar_layout",
    "read_jsonl",
    "summary_line",
]
