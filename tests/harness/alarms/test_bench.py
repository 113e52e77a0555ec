"""The benchmark's plan and its read-back of the recipes' runs (the sweep itself is `stabkit lead-time`'s,
tested there): which runs are lost, and the references counted as healthy runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import stabkit.harness.recipes.science.seeds as seeds
from stabkit.harness.alarms.bench import BenchPlan, loss_fell, planted_spikes, quick_plan, recipe_runs
from stabkit.harness.alarms.corpus import select
from stabkit.harness.alarms.runner import Spike


def test_planted_spikes_early_and_late_both_factors() -> None:
    assert planted_spikes(200) == ((Spike(30, 20.0), Spike(140, 5.0)), (Spike(30, 5.0), Spike(140, 20.0)))
    assert planted_spikes(100) == ((Spike(20, 20.0), Spike(70, 5.0)), (Spike(20, 5.0), Spike(70, 20.0)))


def test_quick_plan_is_the_ci_subset() -> None:
    plan = quick_plan()
    healthy, planted = plan.jobs()
    assert [j.config for j in healthy] == select(tag="ci") and all(j.steps == 100 for j in healthy)
    assert len(planted) == 4 and {j.config.name for j in planted} == {c.name for c in select(tag="ci")[:2]}
    assert plan.seeds == 1 and len(plan.recipes) == 2


def test_loss_fell() -> None:
    assert loss_fell({"first_loss": 5.0, "last_loss": 3.0})
    assert not loss_fell({"first_loss": 5.0, "last_loss": 4.8})
    assert not loss_fell({"first_loss": 5.0, "last_loss": 3.0, "error": "boom"})


def test_recipe_runs_reads_back_lost_baselines_and_references(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(seeds, "run_seeds", lambda *a, **k: None)  # the sweep's output is written below
    events = [{"step": 40, "kind": "spike", "severity": "warning"}]
    variants = {
        "baseline": {"role": "baseline", "first_nonfinite_step": 57, "event_list": events},
        "clean": {"role": "reference", "first_nonfinite_step": float("nan"), "val_loss": 2.0, "bigram_loss": 2.5,
                  "event_list": [{"step": 3, "kind": "drift", "severity": "info"}]},
    }  # fmt: skip
    fine = {
        "baseline": {"role": "baseline", "val_loss": 2.0, "bigram_loss": 2.5, "event_list": []},
        "clean": {"role": "reference", "val_loss": 2.0, "bigram_loss": 2.5, "event_list": []},
    }
    for seed, vs in ((0, variants), (1, fine)):
        folder = tmp_path / "r" / f"seed{seed}"
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps({"steps": 300, "variants": vs}))
    plan = BenchPlan([], [], recipes=("r",), seeds=2)
    lost, refs = recipe_runs(plan, tmp_path)
    assert [(r.label, r.lost, list(r.events)) for r in lost] == [("r s0 baseline", 57, events)]
    assert [(r["label"], r["steps"], len(r["events"])) for r in refs] == [
        ("r s0 clean", 300, 1),
        ("r s1 clean", 300, 0),
    ]
