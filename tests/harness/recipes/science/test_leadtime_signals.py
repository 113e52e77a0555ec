"""The lead-time table with the leading-signal detectors: post-norm without warmup is warned at step 0 by
the depth-gradient check, and the reference (the same post-norm model with warmup) stays quiet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stabkit.harness.recipes.science.seeds import run_seeds


def test_post_norm_without_warmup_is_warned_at_init_and_its_reference_is_quiet(tmp_path: Path) -> None:
    report = run_seeds(["post-norm-no-warmup"], [0], tmp_path, steps=30)
    summary = json.loads((tmp_path / "post-norm-no-warmup" / "seed0" / "summary.json").read_text())
    base, ref = summary["variants"]["baseline"], summary["variants"]["warmup"]
    depth = [e for e in base["event_list"] if e["kind"] == "depth_grad"]
    assert [e["step"] for e in depth] == [0] and depth[0]["value"] > 1.3
    assert ref["event_list"] == []  # warmup passed to attach: the imbalance is what warmup is for
    (row,) = report.rows
    assert (row.false_alarms, row.reference_runs) == (0, 1)


@pytest.mark.slow
def test_lead_time_rows_over_three_seeds(tmp_path: Path) -> None:
    """Measured (tiny, seeds 0-2, 300 steps, 2 shared cores, 5 min): post-norm-no-warmup lost 3/3,
    warned 3/3 by depth_grad at step 0 (scores 2.29 / 3.27 / 2.92 against 1.3), median lead 269,
    worst 254; no detector event on the three reference runs (post-norm with warmup)."""
    report = run_seeds(["post-norm-no-warmup"], [0, 1, 2], tmp_path)
    (row,) = report.rows
    assert (row.lost, row.warned_in_time, row.false_alarms) == (3, 3, 0)
    assert row.first_kinds == ["depth_grad"] * 3
    assert row.median_lead is not None and row.median_lead >= 250
    assert row.worst_lead is not None and row.worst_lead >= 250
