"""Stress-test recipes: make an instability happen on purpose, then show which intervention fixes it.

``load_recipe("attention-logit-growth", "tiny")`` reads and validates ``recipes/<name>.toml``;
``run_recipe(recipe, "runs/x", workers=2)`` trains the baseline and every variant side by side and
judges them; ``run_sweep`` draws LR-sensitivity curves (Wortsman et al. 2023 §2.2).
"""

from .checks import RUN_QUANTITIES, SWEEP_QUANTITIES, Check
from .errors import RecipeError
from .loader import find_recipe, list_recipe_files, load_recipe
from .recipe import Recipe, VariantSpec
from .runner import SUMMARY, preflight, run_recipe
from .sweep import lr_sensitivity, run_sweep

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
