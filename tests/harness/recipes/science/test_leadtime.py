"""The lead-time table: when a run is lost, which event warned first, the lead time, false alarms —
checked on hand-written event logs and held-out curves whose answers are worked out here, and on a
real (short) nan-injection sweep, where the run is lost on the fault's step and warned on it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from stabkit.harness.recipes.science.leadtime import (
    first_warning,
    format_table,
    lead_row,
    lost_step,
    recipe_runs,
    run_lead,
)
from stabkit.harness.recipes.science.seeds import run_seeds, seed_recipe

BIGRAM = 2.317


def result(
    curve: list[list[float]] | None = None,
    events: list[dict[str, Any]] | None = None,
    nonfinite: float = math.nan,
    role: str = "baseline",
) -> dict[str, Any]:
    curve = curve or [[0, 5.5], [100, 2.2]]
    out: dict[str, Any] = {
        "role": role,
        "val_curve": curve,
        "val_loss": curve[-1][1],
        "bigram_loss": BIGRAM,
        "first_nonfinite_step": nonfinite,
        "event_list": events or [],
    }
    for e in events or []:
        out[f"events/{e['kind']}"] = out.get(f"events/{e['kind']}", 0) + 1
    return out


def ev(kind: str, step: int) -> dict[str, Any]:
    return {"kind": kind, "step": step, "where": "blocks.0.attn", "message": "x"}


# ---- when is a run lost ----------------------------------------------------------------------


def test_a_nonfinite_loss_loses_the_run_on_its_step() -> None:
    assert lost_step(result(nonfinite=37)) == 37


def test_a_run_that_climbs_back_to_the_bigram_level_is_lost_where_it_stays_there() -> None:
    # best at 40 steps (2.1); 60 steps: 2.2 (still below 2.317); from 80 steps on at or above:
    # lost after 80 steps done, i.e. on step 79
    curve = [[0, 5.5], [20, 2.5], [40, 2.1], [60, 2.2], [80, 2.4], [100, 2.6]]
    assert lost_step(result(curve)) == 79


def test_a_dip_below_the_bigram_level_postpones_the_loss() -> None:
    curve = [[0, 5.5], [20, 2.1], [40, 2.4], [60, 2.2], [80, 2.5], [100, 2.6]]
    assert lost_step(result(curve)) == 79


def test_a_run_that_never_learns_past_bigram_is_lost_where_its_reference_had() -> None:
    stuck = [[0, 5.5], [20, 3.0], [40, 2.8], [60, 2.75], [80, 2.7], [100, 2.6]]  # still improving
    healthy = result([[0, 5.5], [20, 2.9], [40, 2.5], [60, 2.3], [80, 2.2], [100, 2.1]])
    assert lost_step(result(stuck), healthy) == 59  # the reference was below 2.317 after 60 steps
    assert lost_step(result(stuck)) == 99  # no reference: its best point, the last
    never = result([[0, 5.5], [50, 2.5], [100, 2.4]])  # a reference that never got there either
    assert lost_step(result([[0, 5.5], [20, 3.0], [40, 2.6], [60, 2.9]]), never) == 39  # best point


def test_a_run_that_ends_below_the_bigram_level_is_not_lost() -> None:
    curve = [[0, 5.5], [20, 2.5], [40, 2.4], [60, 2.2]]  # above bigram on the way, fine at the end
    assert lost_step(result(curve)) is None


# ---- warnings and lead times -----------------------------------------------------------------


def test_actions_own_events_are_not_warnings_and_the_earliest_detector_event_is() -> None:
    events = [ev("spike", 90), ev("rescue", 10), ev("drift", 30)]
    first = first_warning(events)
    assert first is not None and (first["kind"], first["step"]) == ("drift", 30)


def test_lead_times_and_false_alarms_over_seeds() -> None:
    lost_at_79 = [[0, 5.5], [40, 2.1], [80, 2.5], [100, 2.6]]
    runs = [
        run_lead(0, result(events=[ev("drift", 30), ev("nonfinite", 50)], nonfinite=50), "reproduced"),
        run_lead(1, result(lost_at_79, events=[ev("rescue", 5), ev("spike", 89)]), "reproduced"),
        run_lead(2, result(nonfinite=60), "reproduced"),  # lost, never warned
        run_lead(3, result(events=[ev("drift", 70)]), "not reproduced"),  # warned, not lost
        run_lead(0, result(events=[ev("spike", 3), ev("spike", 9)], role="reference")),
        run_lead(1, result(role="reference")),
    ]
    assert [r.lead for r in runs[:4]] == [20, -10, None, None]
    row = lead_row("demo", runs)
    assert (row.seeds, row.reproduced, row.lost) == (4, 3, 3)
    assert (row.warned_in_time, row.warned_late, row.never_warned) == (1, 1, 1)
    assert row.median_lead == 5.0 and row.worst_lead == -10  # median of 20 and -10
    assert row.warned_not_lost == 1
    assert (row.false_alarms, row.false_alarm_runs, row.reference_runs) == (2, 1, 2)
    assert sorted(row.first_kinds) == ["drift", "drift", "spike"]
    table = format_table([row])
    assert "| demo | 3/4 | 3/4 | 1/3 | 5 | -10 | 1 / 1 | 2 (1/2) | drift, spike |" in table


def test_notes_are_neither_warnings_nor_false_alarms() -> None:
    note = {**ev("drift", 5), "severity": "info"}
    r = result(events=[note, ev("spike", 9)], role="reference")
    assert run_lead(0, r).events == 1  # the spike; the note is not an alarm
    lost = result(events=[note, ev("spike", 9)], nonfinite=40)
    assert (run_lead(0, lost).warned_at, run_lead(0, lost).warned_by) == (9, "spike")


def test_the_event_count_is_not_capped_by_the_kept_event_list() -> None:
    r = result(events=[ev("spike", 3)], role="reference")
    r["events/spike"] = 75  # the summary keeps the first 50 events; the counts are complete
    assert run_lead(0, r).events == 75


def test_rows_come_from_recorded_summaries(tmp_path: Path) -> None:
    summary = {
        "variants": {
            "baseline": result(events=[ev("drift", 12)], nonfinite=40),
            "stuck": {**result([[0, 5.5], [50, 2.9], [100, 2.8]], [ev("spike", 20)]), "role": "baseline"},
            "qk_norm": {**result(), "role": "intervention"},
            "reference": result(role="reference"),
        },
        "verdicts": {"baseline": {"verdict": "reproduced"}},
    }
    path = tmp_path / "summary.json"
    path.write_text(json.dumps(summary))
    runs = recipe_runs({0: json.loads(path.read_text())})
    assert [r.role for r in runs] == ["baseline", "baseline", "reference"]  # interventions: not timed
    assert runs[0].lead == 28 and runs[0].reproduced
    # never below the bigram level; the reference (5.5 -> 2.2) was after 100 steps: lost on step 99
    assert runs[1].lost == 99 and runs[1].lead == 79 and not runs[1].reproduced


# ---- a real sweep ----------------------------------------------------------------------------


def test_seed_recipe_keeps_baseline_and_reference_with_a_curve() -> None:
    recipe = seed_recipe("attention-logit-growth", "tiny", 2, steps=60)
    assert [v.role for v in recipe.variants] == ["baseline", "reference"]
    assert all(v.train.seed == 2 and v.train.eval_every == 3 for v in recipe.variants)


@pytest.fixture(scope="module")
def nan_sweep(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    out = tmp_path_factory.mktemp("lead")
    return out, run_seeds(["nan-injection"], [0], out, steps=40)


def test_an_injected_nan_is_lost_and_warned_on_the_fault_step(nan_sweep: tuple[Path, Any]) -> None:
    out, report = nan_sweep
    summary = json.loads((out / "nan-injection" / "seed0" / "summary.json").read_text())
    base = summary["variants"]["baseline"]
    fault = int(base["fault_step"])  # scaled down with the run: 150 * 40 // 300 = 20
    assert fault == 20 and base["first_nonfinite_step"] == fault
    assert [s for s, _ in base["val_curve"]] == [0, *range(2, 40, 2), 40]
    (row,) = report.rows
    assert (row.lost, row.warned_in_time, row.median_lead, row.worst_lead) == (1, 1, 0, 0)
    assert row.first_kinds == ["nonfinite"]
    assert (row.false_alarms, row.reference_runs) == (0, 1)  # the clean run stays quiet
    table = (out / "lead_time.md").read_text()
    assert table.splitlines()[2].startswith("| nan-injection | 1/1 | 1/1 | 1/1 | 0 | 0 |")


def test_a_second_sweep_reads_finished_runs_back(nan_sweep: tuple[Path, Any]) -> None:
    out, first = nan_sweep
    path = out / "nan-injection" / "seed0" / "summary.json"
    saved = json.loads(path.read_text())
    saved["verdicts"]["baseline"]["verdict"] = "not reproduced"  # as if judged by older criteria
    path.write_text(json.dumps(saved))
    again = run_seeds(["nan-injection"], [0], out, steps=40)  # reads back and judges again
    assert again.reused == ["nan-injection seed 0"]
    assert [r.to_dict() for r in again.rows] == [r.to_dict() for r in first.rows]


def test_the_held_out_curve_does_not_change_training(tmp_path: Path) -> None:
    from dataclasses import replace

    from stabkit.harness.recipes.run.job import Job
    from stabkit.harness.recipes.run.worker import run_job

    recipe = seed_recipe("attention-logit-growth", "tiny", 0, steps=12)
    ref = recipe.variant("reference")
    plain = replace(ref.train, eval_every=0)
    results = []
    for i, train in enumerate((plain, replace(plain, eval_every=4))):
        ref.train = train
        results.append(run_job(Job(recipe, "reference", str(tmp_path / str(i)))))
    without, with_curve = results
    assert without.val_curve is None and with_curve.val_curve is not None
    assert [s for s, _ in with_curve.val_curve] == [0, 4, 8, 12]
    assert "val_curve" not in without.to_dict()
    for key in ("final_loss", "best_loss", "val_loss", "max_attn_logit"):
        assert with_curve.to_dict()[key] == without.to_dict()[key], key
