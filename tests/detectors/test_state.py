"""Detector state survives a checkpoint: state_dict -> JSON -> load_state_dict continues exactly."""

from __future__ import annotations

import copy
import json

import pytest
from zoo import reference_gpt

import stabkit
from stabkit.detectors import DetectConfig, DetectorContext, Judge

from .helpers import realistic_rows

Rows = list[tuple[int, dict[str, float]]]


def eventful_rows() -> Rows:
    """1200 realistic steps with two loss spikes and attention-logit growth in the second half."""
    rows = realistic_rows(1200, seed=7)
    for step, row in rows:
        if step in (700, 950):
            row["loss"] *= 4
        if step >= 800 and "attn/blocks.0.attn/max_logit" in row:
            row["attn/blocks.0.attn/max_logit"] = 30 * 1.01 ** (step - 800)
    return rows


def handle() -> Judge:
    """The detectors of a reference GPT, fed plain rows (no model, no monitor)."""
    model_map = stabkit.inspect_model(reference_gpt(vocab_size=256))
    return Judge(DetectorContext.from_model_map(model_map, DetectConfig()))


def feed(h: Judge, rows: Rows) -> tuple[list[tuple], list[dict[str, float]]]:
    rows = copy.deepcopy(rows)
    found = []
    for i in range(0, len(rows), 50):
        found += h.rows(rows[i : i + 50])
    events = [(e.step, e.kind, e.where, e.value) for e in found]
    return events, [row for _, row in rows]


def test_state_round_trips_through_json() -> None:
    rows = eventful_rows()
    first, second = rows[:600], rows[600:]
    original = handle()
    feed(original, first)
    state = json.loads(json.dumps(original.state_dict()))
    restored = handle()
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    expected_events, expected_rows = feed(original, second)
    events, scored_rows = feed(restored, second)
    assert events == expected_events
    assert {e[1] for e in events} == {"spike", "drift"}
    assert scored_rows == expected_rows
    fresh_events, fresh_rows = feed(handle(), second)  # without the state the results differ
    assert fresh_rows != expected_rows or fresh_events != expected_events


def test_state_from_another_version_is_refused() -> None:
    state = handle().state_dict()
    state["version"] = 999
    with pytest.raises(ValueError, match="version"):
        handle().load_state_dict(state)
