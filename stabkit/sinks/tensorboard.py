"""TensorBoard sink: scalars named as metrics, events as scalars and text, per-layer multiline charts.

Runs at each log interval (after the host copy) and on every event; never computes statistics.
TensorBoard writes from a background thread; when the disk refuses a write, that thread stops and
the next call here raises its OSError (`SinkSet` then warns once and switches this sink off), so
the thread's own traceback is not printed as well (`quiet_writer_thread_errors`).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

from tensorboard.compat.proto.summary_pb2 import Summary

from ..events import Event
from .checksums import use_fast_checksums


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

_quiet = False


def quiet_writer_thread_errors() -> None:
    """Once per process, when the first TensorBoard sink is made: an OSError that ends TensorBoard's
    writer thread is not printed by `threading.excepthook` (the sink raises it in the caller's
    thread, where stabkit reports it); every other thread error goes to the previous hook."""
    global _quiet
    if _quiet:
        return
    _quiet = True
    previous = threading.excepthook

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, OSError) and type(args.thread).__name__ == "_AsyncWriterThread":
            return
        previous(args)

    threading.excepthook = hook


class TensorBoardSink:
    """Writes to `logdir` with torch.utils.tensorboard's SummaryWriter."""

    def __init__(self, logdir: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.label = f"TensorBoard events in {logdir}"
        quiet_writer_thread_errors()
        use_fast_checksums()  # C checksums when google-crc32c is installed (stabkit[fast])
        self.writer = SummaryWriter(log_dir=str(logdir))
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
        self.writer._get_file_writer().add_summary(summary, step)
        new = set(values) - self._layout_names
        if new:
            self._layout_names |= new
            self.writer.add_custom_scalars(custom_scalar_layout(sorted(self._layout_names)))

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
            self.writer.add_histogram_raw(
                tag,
                min=0.0,
                max=float(n - 1),
                num=total,
                sum=sum(i * c for i, c in enumerate(counts)),
                sum_squares=sum(i * i * c for i, c in enumerate(counts)),
                bucket_limits=[i + 0.5 for i in range(n)],
                bucket_counts=counts,
                global_step=step,
            )

    def write_event(self, event: Event) -> None:
        """An event as its own scalar (`events/<kind>`, not hidden by outlier scaling; `events/<severity>`
        = 1 at its step) and as text with its severity; flushed."""
        self.writer.add_scalar(f"events/{event.kind}", event.value, event.step)
        self.writer.add_scalar(f"events/{event.severity}", 1.0, event.step)
        self.writer.add_text(f"events/{event.kind}", f"**{event.severity.upper()}** {event}", event.step)
        self.writer.flush()

    def write_record(self, kind: str, data: dict[str, Any]) -> None:
        """Records are for the JSONL log: nothing to do here."""

    def write_text(self, tag: str, text: str, step: int = 0) -> None:
        """Free text (audit report, active interventions)."""
        self.writer.add_text(tag, text, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()
