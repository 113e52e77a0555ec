"""Find a recipe file, read its TOML, merge the chosen size's table over it, and parse it.

Runs once, when a command starts. A recipe is named by a path (``my-recipe.toml``) or by its bare
name (``loss-spike``), looked up in ``./recipes`` and among the built-ins. The built-ins have one
copy, the repository's top-level ``recipes/`` folder: a source checkout or an editable install
reads it in place; a wheel ships it as package data (``stabkit/harness/recipes/builtin``, mapped
to ``recipes/`` in pyproject.toml), so a wheel install finds them by name from any folder too.
"""

from __future__ import annotations

import math
import sys
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...models.presets import PRESETS
from ...models.spec import ModelSpec, ModelSpecError
from .errors import RecipeError
from .fields import deep_merge, table

if TYPE_CHECKING:
    from .recipe import Recipe

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

BUILTIN_PACKAGE = "stabkit.harness.recipes"
BUILTIN_FOLDER = "builtin"
"""In a wheel the built-in recipes are package data, ``stabkit/harness/recipes/builtin/*.toml``
(pyproject.toml maps the data package ``stabkit.harness.recipes.builtin`` to ``recipes/``)."""
SOURCE_FOLDER = "recipes"
"""The built-ins' one copy: the ``recipes/`` folder at the top of the repository (beside
pyproject.toml), read in place by a source checkout or an editable install."""
USER_FOLDER = "recipes"
"""A ``./recipes`` folder in the working directory: recipes found there by bare name come first."""


def builtin_dir() -> Path:
    """The folder of the built-in recipes: the wheel's package data, else the checkout's ``recipes/``."""
    shipped = Path(str(resources.files(BUILTIN_PACKAGE).joinpath(BUILTIN_FOLDER)))
    return pick_builtin_dir(shipped, Path(__file__).resolve().parents[4])


def pick_builtin_dir(shipped: Path, root: Path) -> Path:
    """`shipped` (a wheel install's package data) where it exists; else ``<root>/recipes`` where `root`
    is a source checkout (it holds pyproject.toml); else `shipped` (then no built-in is found)."""
    if shipped.is_dir():
        return shipped
    source = root / SOURCE_FOLDER
    if (root / "pyproject.toml").is_file() and source.is_dir():
        return source
    return shipped


def builtin_recipes() -> dict[str, Path]:
    """Built-in recipe name -> its file."""
    return {p.stem: p for p in sorted(builtin_dir().glob("*.toml"))}


def recipe_dirs() -> list[Path]:
    """Folders searched for recipes by bare name, in order: ``./recipes``, then the built-ins."""
    out: list[Path] = []
    for d in (Path.cwd() / USER_FOLDER, builtin_dir()):
        if d.is_dir() and d.resolve() not in [o.resolve() for o in out]:
            out.append(d)
    return out


def find_recipe(spec: str | Path) -> Path:
    """The recipe file for a path or a bare name (``./recipes/<name>.toml``, else a built-in).

    A path that does not exist but reads like an old command (``recipes/<name>.toml``, the
    repository's folder, run from another folder) names the built-in of that name. Otherwise
    FileNotFoundError, one line, with the names that exist.
    """
    path = Path(spec)
    if path.is_file():
        return path
    if path.suffix != ".toml" and len(path.parts) == 1:
        for d in recipe_dirs():
            candidate = d / f"{path.name}.toml"
            if candidate.is_file():
                return candidate
    builtin = builtin_recipes()
    if path.suffix == ".toml" and path.parent.name == USER_FOLDER and path.stem in builtin:
        return builtin[path.stem]
    known = ", ".join(sorted(p.stem for p in list_recipe_files())) or "none found"
    raise FileNotFoundError(f"recipe {str(spec)!r} not found (a .toml path or one of: {known})")


def list_recipe_files() -> list[Path]:
    """Every recipe file in `recipe_dirs()` (a name found twice: the first folder wins)."""
    seen: dict[str, Path] = {}
    for d in recipe_dirs():
        for p in sorted(d.glob("*.toml")):
            seen.setdefault(p.stem, p)
    return [seen[k] for k in sorted(seen)]


def read_toml(path: Path) -> dict[str, Any]:
    """The TOML document at `path`; syntax errors become a RecipeError naming the file."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError("syntax", str(exc), str(path)) from None


def resolve_size(doc: dict[str, Any], size: str | None) -> tuple[dict[str, Any], str]:
    """The document with ``[sizes.<size>]`` merged over the top level (size None: the recipe's
    ``size`` key, else tiny), and the size."""
    from .recipe import SIZE_KEYS  # the parser imports torch: `stabkit list recipes` does not need it

    chosen = size or doc.get("size", "tiny")
    if chosen not in PRESETS:
        raise RecipeError("size", f"must be one of {', '.join(PRESETS)}, got {chosen!r}")
    sizes = table(doc.get("sizes"), "sizes", tuple(PRESETS))
    base = {k: v for k, v in doc.items() if k != "sizes"}
    base["sizes"] = sizes
    over = table(sizes.get(chosen), f"sizes.{chosen}", SIZE_KEYS)
    over = {k: v for k, v in over.items() if k not in ("expect", "note")}
    return deep_merge(base, over), chosen


def load_recipe(
    spec: str | Path,
    size: str | None = None,
    *,
    steps: int | None = None,
    seed: int | None = None,
    data: str | None = None,
    model: ModelSpec | None = None,
) -> Recipe:
    """Load and validate a recipe for `size`; `steps`, `seed`, `data` and `model` override the file's
    values.

    With `steps` shorter than the recipe's, a [fault] step is scaled by the same factor (so a
    shortened run still meets its fault) and warmup is capped at a fifth of the run. With a `model`
    (or a ``[model] spec``) other than a preset, the recipe is fitted to that model
    (`stabkit.harness.recipes.arch.adapt`: RecipeNotApplicable when its trigger cannot be set up).
    A preset `model` is the reference GPT at that size (the same as `size`).
    """
    from .recipe import parse_recipe

    if model is not None and model.is_reference:
        if size is not None and size != model.target:
            raise ModelSpecError(f"--model {model.target} and --size {size} disagree: give one")
        size, model = model.target, None
    path = find_recipe(spec)
    source = str(path)
    try:
        doc, chosen = resolve_size(read_toml(path), size)
        recipe = parse_recipe(doc, chosen, path.stem, source)
    except RecipeError as exc:
        raise exc.in_file(source) from None
    if steps is not None:
        _override_steps(recipe, steps)
    if seed is not None:
        for spec_ in [recipe.train, *(v.train for v in recipe.variants)]:
            spec_.seed = seed
    if data is not None:
        recipe.data = data
    elif isinstance(recipe.data, str) and not Path(recipe.data).is_absolute():
        recipe.data = str((path.parent / recipe.data).resolve())
    if isinstance(recipe.data, str):
        problem = text_problem(recipe.data, recipe.model.context)
        if problem and data is not None:
            raise ValueError(f"--data: {problem}")
        if problem:
            raise RecipeError("data.path", problem, source)
    if recipe.fault is not None and recipe.fault.step >= recipe.train.steps:
        raise RecipeError(
            "fault.step", f"must be below train.steps = {recipe.train.steps}, got {recipe.fault.step}", source
        )
    arch = model or recipe.arch
    recipe.arch = None if arch is None or arch.is_reference else arch
    if recipe.arch is not None:
        from .arch import adapt, placement_of

        recipe.adaptation = adapt(recipe, recipe.arch, placement_of(recipe.arch, recipe.model))
    return recipe


def text_problem(path: str | Path, context: int) -> str | None:
    """What makes `path` unusable as training text for a model with this `context` (missing, not a
    file, too short for both the training and the held-out split), or None. Runs at load, so the
    CLI answers before any worker starts."""
    from ...data.text import MIN_TEXT_BYTES, VAL_FRACTION

    p = Path(path)
    if not p.exists():
        return f"file {str(p)!r} does not exist"
    if not p.is_file():
        return f"{str(p)!r} is not a file"
    need = max(MIN_TEXT_BYTES, math.ceil((context + 2) / VAL_FRACTION))
    size = p.stat().st_size
    if size < need:
        return (
            f"{str(p)!r} has {size} bytes; training needs at least {need} (at least {MIN_TEXT_BYTES}, and a "
            f"held-out {VAL_FRACTION:.0%} longer than the context {context} + 1)"
        )
    return None


def _override_steps(recipe: Recipe, steps: int) -> None:
    if steps < 1:
        raise RecipeError("steps", f"must be >= 1, got {steps}")
    original = recipe.train.steps
    for spec in [recipe.train, *(v.train for v in recipe.variants)]:
        if steps < spec.steps:
            spec.warmup = min(spec.warmup, steps // 5)
        spec.steps = steps
    if recipe.fault is not None and steps < original:
        recipe.fault.step = min(steps - 1, recipe.fault.step * steps // original)
