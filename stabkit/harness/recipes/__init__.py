"""Stress-test recipes: make an instability happen on purpose, then show which intervention fixes it.

``load_recipe("attention-logit-growth", "tiny")`` reads and validates a built-in recipe
(``recipes/<name>.toml`` at the top of the repository, in the wheel as the
``stabkit.harness.recipes.builtin`` package data) or any recipe file;
``run_recipe(recipe, "runs/x", workers=2)`` trains the baseline and every variant side by side and
judges them; ``run_sweep`` draws LR-sensitivity curves (Wortsman et al. 2023 §2.2).

The names below load with their submodule on first use (PEP 562): listing and reading recipe files
(`stabkit.harness.recipes.spec.loader`) does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...lazy import lazy_names

if TYPE_CHECKING:
    from .run.runner import SUMMARY, preflight, run_recipe
    from .science.sweep import lr_sensitivity, run_sweep
    from .spec.checks import RUN_QUANTITIES, SWEEP_QUANTITIES, Check
    from .spec.errors import RecipeError
    from .spec.loader import find_recipe, list_recipe_files, load_recipe
    from .spec.recipe import Recipe, VariantSpec

_LAZY = {
    "RUN_QUANTITIES": "spec.checks",
    "SWEEP_QUANTITIES": "spec.checks",
    "Check": "spec.checks",
    "RecipeError": "spec.errors",
    "find_recipe": "spec.loader",
    "list_recipe_files": "spec.loader",
    "load_recipe": "spec.loader",
    "Recipe": "spec.recipe",
    "VariantSpec": "spec.recipe",
    "SUMMARY": "run.runner",
    "preflight": "run.runner",
    "run_recipe": "run.runner",
    "lr_sensitivity": "science.sweep",
    "run_sweep": "science.sweep",
}


__getattr__ = lazy_names(__name__, _LAZY)


__all__ = [
    "RUN_QUANTITIES",
    "SUMMARY",
    "SWEEP_QUANTITIES",
    "Check",
    "Recipe",
    "RecipeError",
    "VariantSpec",
    "find_recipe",
    "list_recipe_files",
    "load_recipe",
    "lr_sensitivity",
    "preflight",
    "run_recipe",
    "run_sweep",
]
