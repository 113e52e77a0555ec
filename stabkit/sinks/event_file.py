"""A TensorBoard event file written in the caller's thread, one append per flush.

TensorBoard's own writer (``torch.utils.tensorboard.SummaryWriter``) hands every event to a writer
thread through a queue of ten: at a log interval of 50 rows the training thread waits on that queue
for each row after the tenth, and the handover costs more than the write (~60 µs a row of six scalars
against ~10 µs here, measured on one CPU thread; `stabkit bench --size small-step`). Here each event
is framed (TFRecord: length, masked CRC-32C of it, the serialized `Event`, masked CRC-32C of that,
by TensorBoard's own `RecordWriter`, so `stabkit.sinks.checksums` applies) into a buffer in memory,
and `flush` appends the buffer to the file in one write — the monitor flushes at each log interval,
on every event and at detach, so a crash loses nothing a flush had reached, as before.

The file is named as TensorBoard names its own (``events.out.tfevents.<time>.<host>.<pid>.<n>``) and
starts with the ``file_version`` event; it is opened for each flush (append), so a disk error (full
disk, read-only remount) surfaces in the `flush` that meets it, in the caller's thread, where
`stabkit.sinks.fanout.SinkSet` warns once and switches the sink off.

When it runs: `write` at each log interval (after the host copy), on events and text; `flush` right
after; never inside a training step's hooks.
"""

from __future__ import annotations

import itertools
import os
import socket
import time
from pathlib import Path

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.record_writer import RecordWriter

FILE_VERSION = "brain.Event:2"
"""What the first event of a TensorBoard event file declares."""

_numbers = itertools.count()
"""Tells apart the files of one process made within the same second."""


class _Buffer:
    """What `RecordWriter` writes into: bytes kept until the next flush."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, chunk: bytes) -> None:
        self.data += chunk

    def flush(self) -> None:
        """Nothing: `EventFile.flush` takes the bytes."""

    def close(self) -> None:
        """Nothing to close."""


class EventFile:
    """One TensorBoard event file in `logdir`: `add` frames an event in memory, `flush` appends."""

    def __init__(self, logdir: str | Path) -> None:
        folder = Path(logdir)
        folder.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_numbers)}"
        self.path = folder / name
        self._buffer = _Buffer()
        self._records = RecordWriter(self._buffer)
        self.closed = False
        with open(self.path, "wb"):  # made now: an unwritable logdir fails at attach
            pass
        self.add(Event(file_version=FILE_VERSION))
        self.flush()

    def add(self, event: Event, step: int | None = None) -> None:
        """Frame `event` (wall time now; `step` when given) into the buffer."""
        event.wall_time = time.time()
        if step is not None:
            event.step = int(step)
        self._records.write(event.SerializeToString())

    def add_summary(self, summary: Summary, step: int | None = None) -> None:
        """An event holding `summary`."""
        self.add(Event(summary=summary), step)

    def flush(self) -> None:
        """Append what was added since the last flush to the file (one open, one write); nothing
        after `close`. On an error the bytes stay buffered and the error is raised."""
        data = self._buffer.data
        if not data or self.closed:
            return
        with open(self.path, "ab") as fh:
            fh.write(data)
        data.clear()

    def close(self) -> None:
        """Flush; then nothing more is written (safe twice)."""
        if self.closed:
            return
        try:
            self.flush()
        finally:  # closed even when that flush fails (then it raises)
            self.closed = True
