"""output-logit-divergence on a shortened run (the mechanism, in CI; the full-size verdict is in
test_slow.py): with no weight decay and qk-norm on, Adam pushes the never-seen bytes' logits down
every step, so the mean output logit drifts far below 0 while log Z stays where training put it;
z-loss pulls log Z towards 0 and leaves that drift alone."""

from __future__ import annotations

from typing import Any

import pytest

from stabkit.harness.recipes import load_recipe
from stabkit.harness.recipes.run.worker import Job, run_job

STEPS = 150


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("old")
    recipe = load_recipe("output-logit-divergence", "tiny", steps=STEPS)
    assert recipe.model.qk_norm and recipe.train.weight_decay == 0.0
    return {name: run_job(Job(recipe, name, str(out / name))).to_dict() for name in ("baseline", "z_loss")}


def test_the_mean_output_logit_drifts_negative_and_log_z_does_not(runs: dict[str, dict[str, Any]]) -> None:
    base = runs["baseline"]
    assert base["status"] == "done" and base["steps_done"] == STEPS
    # measured at 150 steps: mean logit -4.4 (0 at init), mean log Z 6.6 (5.9 at init)
    assert base["mean_logit"] < -3.0
    assert 4.0 < base["mean_logz"] < 9.0


def test_z_loss_pulls_log_z_towards_zero_not_the_mean_logit(runs: dict[str, dict[str, Any]]) -> None:
    base, z = runs["baseline"], runs["z_loss"]
    assert z["mean_abs_logz"] <= base["mean_abs_logz"] - 0.1  # measured 6.37 vs 6.58
    assert z["mean_logit"] < -3.0  # -4.5: the drift is the never-seen tokens', which z-loss leaves alone
