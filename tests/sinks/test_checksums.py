"""TensorBoard's event checksums: the C replacement gives TensorBoard's own value, and event files
written with it read back."""

from __future__ import annotations

import os

import pytest
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboard_masked

from stabkit.sinks import checksums
from stabkit.sinks.tensorboard import TensorBoardSink

pytest.importorskip("google_crc32c")


def test_fast_masked_crc32c_equals_tensorboards_pure_python_one() -> None:
    fast = checksums.fast_masked_crc32c()
    assert fast is not None
    for size in (0, 1, 7, 8, 64, 1000, 10_001):
        data = os.urandom(size)
        assert fast(data) == tensorboard_masked(data), size
    assert fast(bytearray(b"stabkit")) == tensorboard_masked(b"stabkit")


def test_a_sink_switches_the_record_writer_to_it_and_its_events_read_back(tmp_path: os.PathLike) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import record_writer

    sink = TensorBoardSink(tmp_path)
    assert getattr(record_writer.masked_crc32c, "stabkit_fast", False)
    assert checksums.use_fast_checksums()  # a second sink: already on
    sink.write_metrics(3, {"act/blocks.0/rms": 1.5, "loss": 2.25})
    sink.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(3, 2.25)]
    assert [(e.step, e.value) for e in acc.Scalars("act/blocks.0/rms")] == [(3, 1.5)]
