"""Rescue variants: parsing (the baseline's settings plus the action 'rescue'), what a run's rescue
events amount to, and a shortened attention-logit-growth run in which stabkit rescues the baseline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from stabkit.harness.recipes import RecipeError, load_recipe, run_recipe
from stabkit.harness.recipes.results.summary import Summary
from stabkit.harness.recipes.spec.loader import builtin_dir
from stabkit.harness.recipes.spec.rescue import RESCUE_TOLERANCE, rescue_kinds, rescue_quantities, with_rescue


def test_rescue_kinds_are_those_whose_advice_names_a_midrun_fix() -> None:
    # loss spikes advise rollback / a lower LR, post-norm growth a norm placement, update-norm spikes
    # a lower LR and clipping, depth imbalance a warmup: nothing mid-run; massive activations and sink
    # growth (outliers) advise attn_softcap / qk_norm, which can go on mid-run; a collapsing router or
    # dead experts advise aux_free_balance, a drifting router z router_z_loss (mid-run fixes too)
    assert rescue_kinds() == (
        "nonfinite",
        "drift",
        "attn_entropy",
        "outliers",
        "expert_collapse",
        "dead_experts",
        "router_z",
    )


def test_a_rescue_variant_trains_the_baselines_settings_with_the_action_rescue() -> None:
    recipe = load_recipe("attention-logit-growth", "tiny")
    base, rescue = recipe.baseline, recipe.variant("rescue")
    assert rescue.role == "rescue" and rescue.interventions == base.interventions == {}
    assert rescue.train == base.train and rescue.fault == base.fault
    snapshots = rescue.detect.options_for("rollback")
    assert snapshots.snapshot_every == 25 and snapshots.snapshots == 5 and rescue.tolerance == 0.1
    assert rescue.detect.actions["drift"] == ("warn", "rescue") and rescue.detect.actions["spike"] == (
        "warn",
    )
    assert base.detect.actions["drift"] == ("warn",)  # the baseline only warns
    assert with_rescue(rescue.detect) == rescue.detect  # adding it twice changes nothing


def write_recipe(tmp_path: Path, rescue_table: str) -> Path:
    text = (builtin_dir() / "loss-spike.toml").read_text()
    path = tmp_path / "r.toml"
    path.write_text(text + "\n[variants.rescue]\n" + rescue_table)
    return path


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ("interventions = { qk_norm = {} }\n", "variants.rescue.interventions"),
        ("train = { lr = 0.5 }\n", "variants.rescue.train"),
        ("tolerance = -1\n", "variants.rescue.tolerance"),
        ("colour = 1\n", "variants.rescue.colour"),
    ],
)
def test_a_rescue_variant_refuses_settings_of_its_own(tmp_path: Path, table: str, key: str) -> None:
    with pytest.raises(RecipeError, match=key.replace(".", r"\.")):
        load_recipe(write_recipe(tmp_path, table), "tiny")


def test_a_rescue_variant_on_loss_spike_keeps_the_fault_and_the_default_tolerance(tmp_path: Path) -> None:
    recipe = load_recipe(write_recipe(tmp_path, 'description = "d"\n'), "tiny")
    rescue = recipe.variant("rescue")
    assert rescue.fault is True and rescue.tolerance == RESCUE_TOLERANCE
    assert rescue.detect.sync is True  # the recipe's [detect] table, as the baseline has it


def test_rescue_quantities_from_events() -> None:
    events = [
        {"step": 25, "kind": "attn_entropy", "where": "blocks.0.attn", "details": {}},
        {
            "step": 25, "kind": "rescue", "where": "qk_norm", "message": "rescue 1/2 ...",
            "details": {"step": 25, "fix": "qk_norm", "restored_step": 0, "steps_lost": 25, "output_change": 0.1},
        },
        {
            "step": 140, "kind": "rescue", "where": "attn_softcap", "message": "rescue 2/2 ...",
            "details": {"step": 140, "fix": "attn_softcap", "restored_step": 125, "steps_lost": 15},
        },
        {"step": 200, "kind": "rescue", "where": "qk_norm", "message": "rescue failed: ...", "details": {"failed": True}},
    ]  # fmt: skip
    q = rescue_quantities(events)
    assert q["rescue_count"] == 2 and q["rescue_step"] == 25 and q["steps_lost"] == 40
    assert q["rescue_fixes"] == ["qk_norm", "attn_softcap"]
    assert q["rescues"][1]["restored_step"] == 125 and q["rescues"][1]["output_change"] is None
    assert q["rescue_failed"] == {"step": 200, "message": "rescue failed: ..."}
    none = rescue_quantities(events[:1])
    assert none["rescue_count"] == 0 and none["rescue_step"] is None and none["rescue_failed"] is None


# ---- a shortened run: the mechanism, not the numbers (those: test_slow.py)


RESCUE = "rescue_qk_norm"
"""The recipe's rescue variant restricted to qk_norm (its `rescue` variant prefers qk_clip, which adds no parameters)."""


@pytest.fixture(scope="module")
def rescued(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Summary]:
    out = tmp_path_factory.mktemp("rescue")
    recipe = load_recipe("attention-logit-growth", "tiny", steps=60)
    recipe.variants = [v for v in recipe.variants if v.name in ("qk_norm", RESCUE)]
    return out, run_recipe(recipe, out, workers=1)


def test_a_shortened_attention_logit_growth_run_is_rescued_with_qk_norm(
    rescued: tuple[Path, Summary],
) -> None:
    out, summary = rescued
    r = summary.variants[RESCUE]
    assert r["status"] == "done" and r["steps_done"] == 60
    assert r["rescue_count"] >= 1 and r["rescue_fixes"][0] == "qk_norm"
    first = r["rescues"][0]
    assert (
        first["restored_step"] is not None
        and first["steps_lost"] == first["step"] - first["restored_step"] > 0
    )
    assert r["steps_lost"] == sum(x["steps_lost"] for x in r["rescues"])
    assert r["events/rescue"] == r["rescue_count"]
    # the fix is on: the monitor logs it with the run, and the rescued model trained with its gains
    rows = [json.loads(line) for line in (out / RESCUE / "stabkit.jsonl").read_text().splitlines()]
    rescue_rows = [row for row in rows if row.get("type") == "event" and row["kind"] == "rescue"]
    assert rescue_rows and rescue_rows[0]["details"]["fix"] == "qk_norm"
    assert rescue_rows[0]["details"]["new_parameters"] > 0
    v = summary.verdicts[RESCUE]
    assert v["verdict"] in ("rescued", "not rescued") and v["rescue"]["compared_with"] == "qk_norm"
    assert v["rescue"]["steps_lost"] == r["steps_lost"] and v["rescue"]["step"] == first["step"]
    diff = r["val_loss"] - summary.variants["qk_norm"]["val_loss"]
    assert v["checks"][0]["measured"] == pytest.approx(diff)
    assert v["verdict"] == ("rescued" if diff <= 0.1 else "not rescued")


def test_report_shows_the_rescue_events_and_the_verdict(rescued: tuple[Path, Summary]) -> None:
    import stabkit.cli.report_cmd  # noqa: F401  (registers the command)
    from stabkit.cli import main

    out, summary = rescued
    result = CliRunner().invoke(main, ["report", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    step = summary.variants[RESCUE]["rescue_step"]
    assert f"step {step}: [rescue] qk_norm: rescue 1/2 after " in result.output
    assert f"{RESCUE}: {summary.verdicts[RESCUE]['verdict']}" in result.output
    assert f"rescue at step {step}: qk_norm switched on, rolled back to step" in result.output
