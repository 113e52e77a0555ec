"""The results table of a user's own run leaves out the columns it never fills; a recipe's keeps every
column; the legend explains each column shown, and only those."""

from __future__ import annotations

import math

from stabkit.harness.recipes.results.columns import MEANINGS, legend, shown
from stabkit.harness.recipes.results.report import results_legend, results_table
from stabkit.harness.recipes.results.summary import Summary

LOGGED = {"final_loss": 2.5, "best_loss": 2.4, "max_attn_logit": 12.0, "max_logz": 4.0,
          "first_event_step": math.nan, "first_event_kind": "", "status": "logged"}  # fmt: skip


def test_shown_drops_empty_columns_of_a_log_only() -> None:
    headers = ["variant", "final", "val", "verdict"]
    rows = [["run", "2.5", "-", "logged"], ["run-2", "2.1", "-", "logged"]]
    assert shown(headers, rows, "log") == (["variant", "final"], [["run", "2.5"], ["run-2", "2.1"]])
    assert shown(headers, rows, "run") == (headers, rows)
    assert shown(headers, [["run", "2.5", "3.0", "logged"]], "log")[0] == ["variant", "final", "val"]


def test_a_logs_table_and_legend() -> None:
    summary = Summary(kind="log", complete=True, variants={"exp1": dict(LOGGED)})
    header = results_table(summary).splitlines()[0].split("  ")
    header = [h.strip() for h in header if h.strip()]
    assert header == ["variant", "final", "best", "max attn logit", "max logZ"]  # first event: none
    lines = results_legend(summary).splitlines()
    assert lines[0] == "columns:" and [line.split("  ")[1] for line in lines[1:]][:1] == ["final"]
    assert len(lines) == 1 + 4 and all(MEANINGS[h] in results_legend(summary) for h in header[1:])


def test_legend_skips_unknown_headers() -> None:
    assert legend(["variant", "final", "a new column"]) == f"columns:\n  final  {MEANINGS['final']}"
