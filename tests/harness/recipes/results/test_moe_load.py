"""The MoE measures of a run (`stabkit.harness.recipes.results.moe_load`) from hand-written histories,
and a collapsed mixture-of-experts run counted as lost where its router collapsed (the lead time)."""

from __future__ import annotations

import pytest

from stabkit.harness.recipes.results.moe_load import moe_quantities
from stabkit.harness.recipes.science.leadtime import lost_step, run_lead

A, B = "moe/blocks.0.mlp", "moe/blocks.1.mlp"


def history() -> list[tuple[int, dict[str, float]]]:
    rows = []
    for step in range(0, 100, 10):  # layer 1 collapses from step 30 (top-2 of 8: max 3.0, level 2.25)
        vio_b = 0.4 if step < 30 else 2.9
        vio_b = 3.0 if step == 10 else vio_b  # a passing collapse (10 steps) does not count
        vio_b = 2.0 if step == 60 else vio_b  # one dip of the held collapse (1 of 6 values) does not end it
        rows.append(
            (
                step,
                {
                    f"{A}/max_vio": 0.2,
                    f"{B}/max_vio": vio_b,
                    f"{A}/busiest_share": 0.15,
                    f"{B}/busiest_share": 0.1 + vio_b / 8,
                    f"{B}/dead_experts": 0.0 if step < 90 else 3.0,
                },
            )
        )
    return rows


def test_the_worst_layer_s_tail_peak_dead_experts_and_collapse_step() -> None:
    q = moe_quantities(history(), {"blocks.0.mlp": (8, 2), "blocks.1.mlp": (8, 2)})
    assert q is not None
    # tail: the last 10 % of 91 steps (ceil 9.1 = 10 steps): the rows after step 80, i.e. step 90
    assert q["max_vio"] == pytest.approx(2.9) and q["max_vio_at"] == "blocks.1.mlp"
    assert q["peak_max_vio"] == pytest.approx(3.0)
    assert q["busiest_share"] == pytest.approx(0.1 + 2.9 / 8)
    assert q["dead_experts"] == 3.0 and q["collapse_step"] == 30


def test_the_collapse_level_follows_e_and_k() -> None:
    # top-1 of 4: maximum 3.0 as well, level 2.25; top-4 of 8: maximum 1.0, level 0.75 -> 0.4 is not
    assert moe_quantities(history(), {"blocks.0.mlp": (8, 4)})["collapse_step"] is None  # type: ignore[index]
    # at level 0.75 the span from step 10 holds (5 of 6 values at or above it): collapsed from step 10
    assert moe_quantities(history(), {"blocks.1.mlp": (8, 4)})["collapse_step"] == 10  # type: ignore[index]
    assert moe_quantities(history())["collapse_step"] is None  # type: ignore[index]  # layers unknown


def test_no_moe_statistic_no_measures() -> None:
    assert moe_quantities([(0, {"loss": 2.0})]) is None


def test_a_collapsed_run_is_lost_where_it_collapsed_and_the_warning_s_lead_is_counted() -> None:
    run = {
        "role": "baseline",
        "val_loss": 2.17,  # a normal loss: without the collapse step it would not be lost
        "bigram_loss": 2.317,
        "collapse_step": 30,
        "event_list": [{"kind": "expert_collapse", "step": 110, "where": "blocks.1.mlp", "message": "x"}],
        "events/expert_collapse": 1,
    }
    assert lost_step(run) == 30
    lead = run_lead(0, run, "reproduced", frozenset({"expert_collapse"}))
    assert (lead.lost, lead.warned_at, lead.lead) == (30, 110, -80)
    assert lost_step({**run, "collapse_step": None}) is None


def test_the_results_table_shows_maxvio_and_dead_experts_for_a_mixture_of_experts_only() -> None:
    from stabkit.harness.recipes.results.report import results_rows
    from stabkit.harness.recipes.results.summary import Summary

    dense = Summary.from_dict({"recipe": "r", "variants": {"baseline": {"val_loss": 2.2}}})
    assert "MaxVio" not in results_rows(dense)[0]
    moe = Summary.from_dict(
        {"recipe": "r", "variants": {"baseline": {"val_loss": 2.2, "max_vio": 2.456, "dead_experts": 1.0}}}
    )
    headers, rows = results_rows(moe)
    cells = dict(zip(headers, rows[0], strict=True))
    assert (cells["MaxVio"], cells["dead experts"]) == ("2.46", "1")
