"""A check may compare with a named variant (``vs = "variant:<name>"``), and a contrast variant (the
baseline under other settings) is judged "shown" / "not shown" by its own checks; an unknown variant
name is refused when the recipe loads, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from stabkit.harness.recipes.results.verdict import FIXED, NOT_FIXED, NOT_SHOWN, SHOWN, UNDETERMINED, judge
from stabkit.harness.recipes.spec.checks import Check
from stabkit.harness.recipes.spec.errors import RecipeError
from stabkit.harness.recipes.spec.loader import load_recipe

ROLES = {"baseline": "baseline", "capacity": "contrast", "capacity_fix": "intervention"}
REPRO = [Check("max_vio", ">", 2.0)]
COSTS = {"capacity": [Check("val_loss", ">", 0.02, vs="baseline"), Check("max_vio", ">", 2.0)]}
FIX = {"capacity_fix": [Check("val_loss", "<", -0.02, vs="variant:capacity")]}


def run(**values: float) -> dict[str, object]:
    return {"status": "done", **values}


def verdicts(capacity_val: float, fix_val: float) -> dict[str, object]:
    results = {
        "baseline": run(max_vio=2.9, val_loss=2.17),
        "capacity": run(max_vio=2.9, val_loss=capacity_val),
        "capacity_fix": run(max_vio=0.3, val_loss=fix_val),
    }
    return judge(list(ROLES), ROLES, results, REPRO, FIX, COSTS)  # type: ignore[return-value]


def test_a_named_variant_is_compared_with_and_a_contrast_is_shown() -> None:
    v = verdicts(2.24, 2.20)
    assert v["capacity"].verdict == SHOWN  # type: ignore[attr-defined]
    assert v["capacity"].checks[0].measured == pytest.approx(2.24 - 2.17)  # type: ignore[attr-defined]
    assert v["capacity_fix"].verdict == FIXED  # type: ignore[attr-defined]
    assert v["capacity_fix"].checks[0].measured == pytest.approx(2.20 - 2.24)  # type: ignore[attr-defined]
    v = verdicts(2.18, 2.175)  # capacity costs 0.01 only; the fix gains 0.005 only
    assert v["capacity"].verdict == NOT_SHOWN and v["capacity_fix"].verdict == NOT_FIXED  # type: ignore[attr-defined]


def test_a_contrast_without_a_value_is_undetermined() -> None:
    results = {"baseline": run(max_vio=2.9, val_loss=2.17), "capacity": run(val_loss=2.3)}
    v = judge(["baseline", "capacity"], ROLES, results, REPRO, {}, COSTS)
    assert v["capacity"].verdict == UNDETERMINED


def test_an_unknown_variant_name_is_refused_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text(
        'name = "r"\ndescription = "d"\n[variants.baseline]\n[variants.fix]\n'
        'fixed = [{ metric = "val_loss", vs = "variant:nope", op = "<", value = 0 }]\n'
        '[criteria]\nreproduced = [{ metric = "val_loss", op = ">", value = 0 }]\n',
        encoding="utf-8",
    )
    with pytest.raises(RecipeError, match=r"variants\.fix\.fixed\.vs.*names no variant.*'variant:nope'"):
        load_recipe(str(path))
