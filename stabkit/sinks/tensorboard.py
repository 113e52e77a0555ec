"""TensorBoard sink: scalars named as metrics, events as scalars and text, per-layer multiline charts.

Runs at each log interval (after the host copy) and on every event; never computes statistics.
Events go to a `stabkit.sinks.event_file.EventFile`, written in the caller's thread at each flush
(TensorBoard's own writer hands every event to a thread through a queue of ten, which cost the
training thread more than the writing); when the disk refuses a write the flush raises its OSError
(`SinkSet` then warns once and switches this sink off). The summaries are the ones
``torch.utils.tensorboard`` makes (`scalar`, `text`, `histogram_raw`, `custom_scalars`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard.summary import custom_scalars, histogram_raw, scalar
from torch.utils.tensorboard.summary import text as text_summary

from ..events import Event
from .checksums import use_fast_checksums
from .event_file import EventFile


def custom_scalar_layout(names: list[str]) -> dict[str, dict[str, list[Any]]]:
    """One chart per (family, statistic) drawing every layer's curve, e.g. `act/.*/rms`."""
    layout: dict[str, dict[str, list[Any]]] = {}
    for name in sorted(names):
        parts = name.split("/")
        if len(parts) < 3:
            continue
        family, stat = parts[0], parts[-1]
        title = f"{stat} per layer"
        regex = f"^{re.escape(family)}/.*/{re.escape(stat)}$"
        layout.setdefault(family, {})[title] = ["Multiline", [regex]]
    return layout


VECTOR = re.compile(r"^(.+)\[(\d+)\]$")
"""A vector metric's entry: ``name[i]``."""


class TensorBoardSink:
    """Writes a TensorBoard event file in `logdir`."""

    def __init__(self, logdir: str | Path) -> None:
        self.label = f"TensorBoard events in {logdir}"
        use_fast_checksums()  # C checksums when google-crc32c is installed (stabkit[fast])
        self.file = EventFile(logdir)
        self._layout_names: set[str] = set()

    def write_metrics(self, step: int, values: dict[str, float]) -> None:
        """Every metric of `step` as one event holding one scalar value per tag (what add_scalar
        writes, batched: ~10x cheaper than one event per scalar); the multiline layout grows when
        new names appear. Entries of a vector metric, ``name[i]`` (a MoE layer's tokens per expert),
        become one histogram ``name`` over i instead (`write_vectors`)."""
        vectors = {n for n in values if n.endswith("]") and VECTOR.match(n)}
        if vectors:
            self.write_vectors(step, {n: values[n] for n in vectors})
            values = {n: v for n, v in values.items() if n not in vectors}
        summary = Summary(
            value=[Summary.Value(tag=name, simple_value=value) for name, value in values.items()]
        )
        self.file.add_summary(summary, step)
        new = set(values) - self._layout_names
        if new:
            self._layout_names |= new
            self.file.add_summary(custom_scalars(custom_scalar_layout(sorted(self._layout_names))))

    def write_vectors(self, step: int, entries: dict[str, float]) -> None:
        """Vector metrics as histograms: ``name[i] = x`` puts weight x in the bucket of i (so a MoE
        layer's chart shows its tokens per expert, expert index on the x axis, one chart per layer)."""
        groups: dict[str, dict[int, float]] = {}
        for name, value in entries.items():
            m = VECTOR.match(name)
            if m is not None:
                groups.setdefault(m.group(1), {})[int(m.group(2))] = value
        for tag, by_index in groups.items():
            n = max(by_index) + 1
            counts = [max(0.0, by_index.get(i, 0.0)) for i in range(n)]
            total = sum(counts)
            summary = histogram_raw(
                tag,
                min=0.0,
                max=float(n - 1),
                num=total,
                sum=sum(i * c for i, c in enumerate(counts)),
                sum_squares=sum(i * i * c for i, c in enumerate(counts)),
                bucket_limits=[i + 0.5 for i in range(n)],
                bucket_counts=counts,
            )
            self.file.add_summary(summary, step)

    def write_event(self, event: Event) -> None:
        """An event as its own scalar (`events/<kind>`, not hidden by outlier scaling; `events/<severity>`
        = 1 at its step) and as text with its severity; flushed."""
        self.file.add_summary(scalar(f"events/{event.kind}", event.value), event.step)
        self.file.add_summary(scalar(f"events/{event.severity}", 1.0), event.step)
        self.file.add_summary(
            text_summary(f"events/{event.kind}", f"**{event.severity.upper()}** {event}"), event.step
        )
        self.file.flush()

    def write_record(self, kind: str, data: dict[str, Any]) -> None:
        """Records are for the JSONL log: nothing to do here."""

    def write_text(self, tag: str, text: str, step: int = 0) -> None:
        """Free text (audit report, active interventions)."""
        self.file.add_summary(text_summary(tag, text), step)

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()
