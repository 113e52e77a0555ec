"""Readers for the recipe's own keys (the top level, variants, sizes): each checks one key and says
what is allowed when it is wrong. The config tables ([train], [model], [monitor], [detect], ...)
are filled by `stabkit.tables.fill` instead.

Used only while a recipe is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .errors import RecipeError


def table(raw: Any, where: str, allowed: Sequence[str]) -> dict[str, Any]:
    """`raw` as a dict whose keys are all in `allowed` (else a RecipeError naming the first unknown key)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise RecipeError(where, f"must be a table, got {type(raw).__name__}")
    unknown = [k for k in raw if k not in allowed]
    if unknown:
        key = f"{where}.{unknown[0]}" if where else unknown[0]
        raise RecipeError(key, f"unknown key; allowed: {', '.join(allowed)}")
    return dict(raw)


def boolean(raw: Any, where: str) -> bool:
    """true or false."""
    if not isinstance(raw, bool):
        raise RecipeError(where, f"must be true or false, got {raw!r}")
    return raw


def string(raw: Any, where: str) -> str:
    """A string."""
    if not isinstance(raw, str):
        raise RecipeError(where, f"must be a string, got {raw!r}")
    return raw


def choice(raw: Any, where: str, allowed: Sequence[str]) -> str:
    """One of `allowed`."""
    if raw not in allowed:
        raise RecipeError(where, f"must be one of {', '.join(allowed)}, got {raw!r}")
    return str(raw)


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` merged into a copy of `base`: tables merge key by key, everything else is replaced."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out
