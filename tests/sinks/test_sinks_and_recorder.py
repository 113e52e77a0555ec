"""Recorder combine rules, JSONL round trip with non-finite numbers, TensorBoard layout and events."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from stabkit.events import Event
from stabkit.sinks import JsonlSink, SinkSet, TensorBoardSink, custom_scalar_layout, read_jsonl, summary_line
from stabkit.stats import Recorder


def test_recorder_combines_within_a_step_and_drains_in_order() -> None:
    rec = Recorder()
    for v in (3.0, 4.0):
        rec.add("a/max", torch.tensor(v), combine="max")
        rec.add("a/min", torch.tensor(v), combine="min")
        rec.add("a/sum", torch.tensor(v), combine="sum")
        rec.add("a/mean", torch.tensor(v), combine="mean")
        rec.add("a/rms", torch.tensor(v), combine="rms")
        rec.add("a/last", torch.tensor(v))
    rec.commit(7)
    rec.add("a/last", torch.tensor(1.0))
    rec.commit(8)
    rec.commit(9)  # an empty step is not kept
    rows = rec.drain()
    assert [s for s, _ in rows] == [7, 8]
    first = rows[0][1]
    assert (
        first["a/max"] == 4.0 and first["a/min"] == 3.0 and first["a/sum"] == 7.0 and first["a/mean"] == 3.5
    )
    assert first["a/rms"] == pytest.approx(math.sqrt((9 + 16) / 2))
    assert first["a/last"] == 4.0 and rows[1][1] == {"a/last": 1.0}
    assert rec.drain() == []


def test_jsonl_round_trips_nonfinite_numbers_and_events(tmp_path: Path) -> None:
    sink = JsonlSink(tmp_path)
    sink.write_metrics(3, {"x": float("nan"), "y": float("inf"), "z": 1.5})
    sink.write_event(Event(3, "spike", "loss", 10.0, 5.0, "loss spiked", "lower the LR"))
    sink.close()
    sink.close()
    (tmp_path / "stabkit.jsonl").open("a").write('{"type": "metrics", "st')  # a torn last line
    rows = read_jsonl(tmp_path / "stabkit.jsonl")
    assert len(rows) == 2
    vals = rows[0]["values"]
    assert math.isnan(vals["x"]) and vals["y"] == math.inf and vals["z"] == 1.5
    assert rows[1]["kind"] == "spike" and rows[1]["advice"] == "lower the LR"


def test_custom_scalar_layout_groups_layers_per_statistic() -> None:
    layout = custom_scalar_layout(["act/blocks.0/rms", "act/blocks.1/rms", "act/blocks.0/absmax", "loss"])
    assert layout == {
        "act": {
            "absmax per layer": ["Multiline", ["^act/.*/absmax$"]],
            "rms per layer": ["Multiline", ["^act/.*/rms$"]],
        }
    }


def test_tensorboard_writes_scalars_events_and_text(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path)
    sink.write_metrics(0, {"act/blocks.0/rms": 1.0, "loss": 2.0})
    sink.write_event(Event(0, "nonfinite", "blocks.0.mlp", float("nan"), 0.0, "NaN in output"))
    sink.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    acc.Reload()
    assert {"act/blocks.0/rms", "loss", "events/nonfinite"} <= set(acc.Tags()["scalars"])
    assert "events/nonfinite/text_summary" in acc.Tags()["tensors"]


def test_console_line_names_the_worst_layer(capsys: pytest.CaptureFixture[str]) -> None:
    line = summary_line(10, {"loss": 2.5, "act/blocks.0/absmax": 3.0, "act/blocks.1/absmax": 9.0})
    assert line.startswith("[stabkit] step 10") and "loss 2.5" in line and "9 (blocks.1)" in line
    sinks = SinkSet(None, tensorboard=True, jsonl=True, console=True)
    sinks.write_rows([(1, {"loss": 1.0}), (2, {"loss": 0.5})])
    err = capsys.readouterr().err
    assert "step 2" in err and "step 1 " not in err
    sinks.close()


def test_jsonl_hands_rows_to_the_os_each_flush_and_syncs_only_events_and_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A log interval's flush makes its rows readable by another process (a crash of this one loses
    nothing) without an fsync, which on a network filesystem stalls the training thread; an event and
    `close` are synced to the disk."""
    import stabkit.sinks.jsonl as jsonl

    synced: list[int] = []
    monkeypatch.setattr(jsonl.os, "fsync", lambda fd: synced.append(fd))
    sink = JsonlSink(tmp_path)
    for step in range(3):
        sink.write_metrics(step, {"loss": 1.0 + step})
        sink.flush()
        rows = read_jsonl(tmp_path / "stabkit.jsonl")  # another reader sees the row at once
        assert [r["step"] for r in rows] == list(range(step + 1))
    assert synced == []
    sink.write_event(Event(3, "spike", "loss", 9.0, 4.0, "loss spike"))
    assert len(synced) == 1
    sink.close()
    assert len(synced) == 2
    sink.flush()  # after close: nothing, no error
    assert len(synced) == 2 and len(read_jsonl(tmp_path / "stabkit.jsonl")) == 4
