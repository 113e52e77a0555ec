"""The TensorBoard sink's own event file: what TensorBoard's reader reads back from it, written in the
caller's thread, one append per flush, and a disk error raised where the flush meets it."""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from stabkit.events import Event
from stabkit.sinks.event_file import EventFile
from stabkit.sinks.tensorboard import TensorBoardSink


def read(folder: Path) -> EventAccumulator:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_every_kind_of_record_reads_back_in_tensorboard(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path)
    sink.write_metrics(0, {"loss": 2.5, "act/blocks.0/rms": 1.25, "act/blocks.1/rms": 0.5})
    sink.write_metrics(1, {"loss": 2.0, "moe/blocks.0/tokens[0]": 3.0, "moe/blocks.0/tokens[2]": 1.0})
    sink.write_text("stabkit/audit", "all good", 1)
    sink.write_event(
        Event(
            step=1,
            kind="spike",
            where="loss",
            value=9.0,
            threshold=4.0,
            message="loss jumped",
            severity="info",
        )
    )
    sink.close()
    acc = read(tmp_path)
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(0, 2.5), (1, 2.0)]
    assert [(e.step, e.value) for e in acc.Scalars("act/blocks.1/rms")] == [(0, 0.5)]
    assert [(e.step, e.value) for e in acc.Scalars("events/spike")] == [(1, 9.0)]
    assert [(e.step, e.value) for e in acc.Scalars("events/info")] == [(1, 1.0)]
    hist = acc.Histograms("moe/blocks.0/tokens")[0]
    assert hist.step == 1 and hist.histogram_value.bucket == [3.0, 0.0, 1.0]  # expert index on x
    tensors = acc.Tensors("stabkit/audit/text_summary")
    assert tensors[0].step == 1 and tensors[0].tensor_proto.string_val == [b"all good"]
    layout = acc.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0]
    assert b"^act/.*/rms$" in layout  # the per-layer multiline chart, grown with the names


def test_one_file_named_as_tensorboard_names_its_own_and_starting_with_the_version(tmp_path: Path) -> None:
    first, second = EventFile(tmp_path), EventFile(tmp_path)  # one process, one second: two files
    assert first.path != second.path
    for f in (first, second):
        host_pid = f".{os.uname().nodename}.{os.getpid()}."
        assert f.path.name.startswith("events.out.tfevents.") and host_pid in f.path.name
        f.close()
        f.close()  # safe twice
    assert read(tmp_path).FirstEventTimestamp() > 0  # the file_version event leads


def test_writes_stay_in_memory_until_flush_which_appends_them_in_this_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = TensorBoardSink(tmp_path)
    size = sink.file.path.stat().st_size
    threads = threading.active_count()
    for step in range(50):
        sink.write_metrics(step, {"loss": float(step)})
    assert sink.file.path.stat().st_size == size  # nothing on disk yet
    assert threading.active_count() == threads  # and no writer thread
    opened: list[str] = []
    real_open = open

    def counting_open(path: object, mode: str = "r", *args: object, **kwargs: object) -> object:
        opened.append(mode)
        return real_open(path, mode, *args, **kwargs)  # type: ignore[call-overload]

    monkeypatch.setattr("builtins.open", counting_open)
    sink.flush()
    sink.flush()  # nothing new: no open
    monkeypatch.undo()
    assert opened == ["ab"]
    assert [e.value for e in read(tmp_path).Scalars("loss")] == [float(s) for s in range(50)]


def test_a_disk_error_is_raised_by_the_flush_and_the_rows_stay_buffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sink = TensorBoardSink(tmp_path)
    sink.write_metrics(0, {"loss": 1.0})
    sink.flush()
    sink.write_metrics(1, {"loss": 0.5})

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("builtins.open", full)
    with pytest.raises(OSError, match="No space left"):
        sink.flush()
    monkeypatch.undo()
    sink.close()  # the disk has room again: the kept row is written
    assert [(e.step, e.value) for e in read(tmp_path).Scalars("loss")] == [(0, 1.0), (1, 0.5)]


def test_nothing_is_written_after_close(tmp_path: Path) -> None:
    from tensorboard.compat.proto.summary_pb2 import Summary

    events = EventFile(tmp_path)
    events.add_summary(Summary(value=[Summary.Value(tag="loss", simple_value=1.0)]), 0)
    events.close()
    size = events.path.stat().st_size
    events.add_summary(Summary(value=[Summary.Value(tag="loss", simple_value=2.0)]), 1)
    events.flush()
    events.close()
    assert events.path.stat().st_size == size
    assert [(e.step, e.value) for e in read(tmp_path).Scalars("loss")] == [(0, 1.0)]
