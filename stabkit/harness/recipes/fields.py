"""Typed readers for recipe values: each checks one key and says what is allowed when it is wrong.

Used only while a recipe is loaded.
"""

from __future__ import annotations

import math
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


def integer(raw: Any, where: str, lo: int = 0, hi: int | None = None) -> int:
    """An integer in [lo, hi]."""
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < lo or (hi is not None and raw > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise RecipeError(where, f"must be an integer {bound}, got {raw!r}")
    return raw


def number(
    raw: Any,
    where: str,
    lo: float = 0.0,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    """A finite number in the interval [lo, hi] (open ends when asked)."""
    ok = not isinstance(raw, bool) and isinstance(raw, int | float) and math.isfinite(raw)
    if ok:
        ok = (raw > lo if lo_open else raw >= lo) and (hi is None or (raw < hi if hi_open else raw <= hi))
    if not ok:
        left = "(" if lo_open else "["
        right = "inf)" if hi is None else (f"{hi:g})" if hi_open else f"{hi:g}]")
        raise RecipeError(where, f"must be a number in {left}{lo:g}, {right}, got {raw!r}")
    return float(raw)


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


def numbers(
    raw: Any, where: str, length: int | None = None, lo: float = 0.0, lo_open: bool = True
) -> list[float]:
    """An array of finite numbers > lo (exactly `length` of them when given; at least one)."""
    if not isinstance(raw, list) or not raw or (length is not None and len(raw) != length):
        size = f"{length} numbers" if length is not None else "a non-empty array of numbers"
        raise RecipeError(where, f"must be {size}, got {raw!r}")
    return [number(v, f"{where}[{i}]", lo=lo, lo_open=lo_open) for i, v in enumerate(raw)]


def integers(raw: Any, where: str, lo: int = 1) -> list[int]:
    """A non-empty array of integers >= lo."""
    if not isinstance(raw, list) or not raw:
        raise RecipeError(where, f"must be a non-empty array of integers, got {raw!r}")
    return [integer(v, f"{where}[{i}]", lo=lo) for i, v in enumerate(raw)]


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` merged into a copy of `base`: tables merge key by key, everything else is replaced."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out
