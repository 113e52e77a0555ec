"""The alarm table's statistics on hand-made event lists, against counts worked out by hand."""

from __future__ import annotations

import pytest

from stabkit.harness.alarms.stats import ALL, LostRun, format_rows, is_warning, spike_finder, table


def ev(step: int, kind: str, severity: str = "warning") -> dict[str, object]:
    return {"step": step, "kind": kind, "severity": severity, "where": "x", "message": "m"}


HEALTHY = [
    {"steps": 200, "events": [ev(0, "depth_grad"), ev(50, "drift", "info"), ev(60, "drift", "info")]},
    {"steps": 300, "events": [ev(10, "spike"), ev(11, "spike", "critical"), ev(12, "depth_grad", "info")]},
    {"steps": 500, "events": []},
]


def rows_by_kind(rows):  # type: ignore[no-untyped-def]
    return {r.kind: r for r in rows}


def test_severity_decides_what_a_warning_is() -> None:
    assert [is_warning(ev(0, "k", s)) for s in ("info", "warning", "critical")] == [False, True, True]
    assert is_warning({"step": 0, "kind": "k"})  # no severity: an old event log, counted as a warning


def test_false_alarms_notes_and_rate_per_kind() -> None:
    rows = rows_by_kind(table(HEALTHY))
    # by hand: warnings = depth_grad@0 (run 1), spike@10 and spike@11 (run 2); 1000 healthy steps
    assert (rows[ALL].false_alarms, rows[ALL].false_alarm_runs, rows[ALL].notes) == (3, 2, 3)
    assert rows[ALL].per_1000_steps == pytest.approx(3.0)
    assert (rows["spike"].false_alarms, rows["spike"].false_alarm_runs) == (2, 1)
    assert rows["spike"].per_1000_steps == pytest.approx(2.0)
    assert (rows["depth_grad"].false_alarms, rows["depth_grad"].notes) == (1, 1)
    assert (rows["drift"].false_alarms, rows["drift"].notes, rows["drift"].false_alarm_runs) == (0, 2, 0)


def test_planted_spike_found_within_tolerance_by_a_warning_only() -> None:
    events = [ev(29, "spike"), ev(31, "update_norm", "info"), ev(32, "spike"), ev(80, "drift")]
    assert spike_finder(events, 30)["step"] == 32  # type: ignore[index]  # 29 is before, 31 is a note
    assert spike_finder(events, 30, tolerance=1) is None
    assert spike_finder(events, 78) is not None and spike_finder(events, 77) is None
    planted = [
        {"steps": 100, "spikes": [[30, 20.0], [70, 5.0]], "events": events},
        {"steps": 100, "spikes": [[30, 5.0]], "events": [ev(30, "loss_spike"), ev(30, "spike")]},
    ]
    rows = rows_by_kind(table([], planted))
    # by hand: spike@30 found by spike (32), spike@70 missed, run 2's found by the first listed at 30
    assert (rows[ALL].spikes_found, rows[ALL].spikes_planted) == (2, 3)
    assert rows["spike"].spikes_found == 1 and rows["loss_spike"].spikes_found == 1
    assert rows["spike"].spikes_planted == 3
    assert rows[ALL].false_alarms == 0  # warnings on planted runs are not false alarms


def test_lead_times_median_and_worst() -> None:
    lost = [
        LostRun("a", 100, (ev(40, "spike"), ev(90, "drift"), ev(20, "drift", "info"))),
        LostRun("b", 50, (ev(60, "drift"),)),
        LostRun("c", 70, ()),
        LostRun("d", 10, (ev(0, "nonfinite", "critical"), ev(5, "spike"))),
    ]
    rows = rows_by_kind(table([], [], lost))
    # any kind: a: 100-40=60, b: 50-60=-10 (late), d: 10-0=10; c never warned
    assert rows[ALL].leads == [60, -10, 10]
    assert (rows[ALL].lost_warned, rows[ALL].lost_runs) == (2, 4)
    assert rows[ALL].median_lead == 10 and rows[ALL].worst_lead == -10
    # drift's own first warnings: a: 100-90 = 10 (the note at 20 does not count), b: -10
    assert (
        rows["drift"].leads == [10, -10] and rows["drift"].median_lead == 0 and rows["drift"].lost_warned == 1
    )
    assert rows["spike"].leads == [60, 5] and rows["spike"].worst_lead == 5
    text = format_rows(list(rows.values()))
    assert "| all | 0 (0) | 0.00 | 0 | 0/0 | 2/4 | 10 | -10 |" in text
