"""The moe-router-collapse recipe: it loads with its variants, roles and checks, and a CI-sized run of
its baseline (50 steps) reproduces the collapse — one layer's MaxVio past 75 % of its maximum for top-2
of 8 — while the loss keeps falling (the full 3-seed table is in docs/guide/moe.md)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from stabkit.harness.recipes import RecipeError, load_recipe, run_recipe

STEPS = 50


def test_the_recipe_loads_with_its_variants_and_checks(tmp_path: Path) -> None:
    recipe = load_recipe("moe-router-collapse", "tiny")
    assert (recipe.model.n_experts, recipe.model.top_k, recipe.model.capacity_factor) == (8, 2, None)
    roles = {v.name: v.role for v in recipe.variants}
    assert roles == {
        "baseline": "baseline",
        "load_balance_loss": "intervention",
        "aux_free_balance": "intervention",
        "router_z_loss": "intervention",
        "rescue": "rescue",
        "capacity": "contrast",
        "capacity_balanced": "intervention",
        "reference": "reference",
    }
    assert recipe.variant("aux_free_balance").interventions == {"aux_free_balance": {"gamma": 1e-3}}
    assert recipe.model_of(recipe.variant("capacity")).capacity_factor == 1.0
    rescue = recipe.variant("rescue").detect
    assert rescue is not None and "rescue" in rescue.actions["expert_collapse"]
    assert rescue.options["rescue"]["rollback"] is False
    assert [c.metric for c in recipe.reproduced] == ["max_vio", "val_loss"]
    bad = tmp_path / "moe-bad.toml"
    bad.write_text(
        Path(recipe.source).read_text().replace('vs = "variant:capacity"', 'vs = "variant:capacty"')
    )
    with pytest.raises(RecipeError, match="variant:capacty"):
        load_recipe(bad, "tiny")


def test_a_short_run_reproduces_the_collapse_with_a_normal_loss(tmp_path: Path) -> None:
    recipe = load_recipe("moe-router-collapse", "tiny", steps=STEPS)
    recipe.variants = [v for v in recipe.variants if v.role == "baseline"]
    for v in recipe.variants:
        v.train = dataclasses.replace(v.train, eval_batches=2)
    summary = run_recipe(recipe, tmp_path, workers=1)
    base = summary.variants["baseline"]
    assert base["status"] == "done"
    assert base["peak_max_vio"] >= 0.75 * 3.0 and base["max_vio_at"].startswith("blocks.")
    assert base["max_vio"] >= 2.0  # still collapsed at the end (the last 10 % of the run)
    assert math.isfinite(base["val_loss"]) and base["val_loss"] < base["initial_loss"] - 2.0
