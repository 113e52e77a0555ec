"""Fill a dataclass from a plain table (a TOML table, a dict), checking every key and value.

`fill(cls, table, section)` is the one loader behind recipe files and plug-in options: each key
must be a field of `cls`, each value must fit the field's annotation (int, float, bool, str, Literal,
Optional, tuples, lists, sets, dicts, callables, unions of those), and a field may carry a range
(`bounds`, in its metadata) — the one range check of every config filled this way. Anything wrong
raises a `TableError` naming ``section.key`` and what is allowed; the dataclass's own
``__post_init__`` errors are re-raised naming ``section.<field>`` when the message says which field
(``ClassName.field ...``), or the nested key a `TableError` from it names (``ClassName.a.b`` ->
``section.a.b``). TOML has no null: an Optional field takes the string ``"none"`` (or None from
Python). A field marked `merged` is laid over the base's value key by key (nested tables too)
instead of replacing it.

Stdlib only; imported by nothing but the loaders and configs that use it.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, Union

T = TypeVar("T")

NONE = "none"
"""The string an Optional field takes for None (TOML has no null)."""
RANGE = "stabkit.tables.range"
"""Field-metadata key of a `Range`."""
MERGE = "stabkit.tables.merge"
"""Field-metadata key of a dict field whose table is laid over the base's value (`merged`)."""


class TableError(ValueError):
    """A table that does not fit its dataclass: ``<section.key>: <what is wrong and what is allowed>``."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"{key}: {problem}")


@dataclass(frozen=True)
class Range:
    """Allowed interval of a number (of each element, for a tuple or list field)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    hint: str = ""
    """Said after the problem (e.g. what to use instead)."""

    def contains(self, value: float) -> bool:
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return not (self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi))

    def describe(self, integer: bool) -> str:
        if integer and not self.lo_open and not self.hi_open:
            if self.hi is None:
                return f"an integer >= {self.lo:g}" if self.lo is not None else "an integer"
            return f"an integer in [{self.lo if self.lo is not None else '-inf'}, {self.hi:g}]"
        left = "-inf" if self.lo is None else f"{self.lo:g}"
        right = "inf" if self.hi is None else f"{self.hi:g}"
        lb = "(" if self.lo_open or self.lo is None else "["
        rb = ")" if self.hi_open or self.hi is None else "]"
        return f"{'an integer' if integer else 'a number'} in {lb}{left}, {right}{rb}"


def bounds(
    lo: float | None = None,
    hi: float | None = None,
    *,
    lo_open: bool = False,
    hi_open: bool = False,
    hint: str = "",
) -> dict[str, Range]:
    """Field metadata giving the allowed range: ``field(default=1, metadata=bounds(lo=1))``."""
    return {RANGE: Range(lo, hi, lo_open, hi_open, hint)}


def merged() -> dict[str, bool]:
    """Field metadata of a dict field that `fill` lays over the base's value key by key (nested
    tables too) instead of replacing it: ``field(default_factory=dict, metadata=merged())``."""
    return {MERGE: True}


def as_table(value: Any) -> Any:
    """An options dataclass instance as the table of its fields (given directly instead of a dict);
    anything else unchanged. Lets every plug-in family take either, checked by one path."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value) if f.init}
    return value


def keys(cls: type, exclude: Sequence[str] = ()) -> tuple[str, ...]:
    """The keys a table for `cls` may hold (its init fields, in order, less `exclude`)."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.init and f.name not in exclude)


def fill(
    cls: type[T],
    table: Any,
    section: str,
    base: T | None = None,
    *,
    exclude: Sequence[str] = (),
) -> T:
    """An instance of dataclass `cls` with `table`'s values over `base` (the defaults when None).

    Raises TableError naming ``section.key`` for an unknown key (listing the allowed ones), a value
    of the wrong type, one out of its field's range, or one the dataclass itself refuses.
    """
    table = {} if table is None else as_table(table)
    if not isinstance(table, Mapping):
        raise TableError(section, f"must be a table, got {type(table).__name__}")
    allowed = keys(cls, exclude)
    for key in table:
        if key not in allowed:
            raise TableError(_join(section, str(key)), f"unknown key; allowed: {', '.join(allowed)}")
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values = {
        key: convert(raw, hints[key], _join(section, key), by_name[key].metadata.get(RANGE))
        for key, raw in table.items()
    }
    try:
        if base is not None:
            for key in values:
                if by_name[key].metadata.get(MERGE):
                    values[key] = _laid_over(getattr(base, key), values[key])
            return dataclasses.replace(base, **values)  # type: ignore[type-var]
        return cls(**values)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, TableError) and exc.key.startswith(cls.__name__ + "."):
            raise TableError(_join(section, exc.key[len(cls.__name__) + 1 :]), exc.problem) from None
        raise TableError(_field_key(section, cls, str(exc)), " ".join(str(exc).split())) from None


def convert(raw: Any, tp: Any, where: str, limits: Range | None = None) -> Any:
    """`raw` checked against the annotation `tp` (and `limits`), converted where TOML differs
    (an int for a float, an array for a tuple or set, ``"none"`` for None)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return raw
    if origin is Callable:
        if not callable(raw):
            raise TableError(where, f"must be a callable, got {raw!r}")
        return raw
    if origin is Union or origin is types.UnionType:
        return _union(raw, args, where, limits)
    if origin is Literal:
        if raw not in args or isinstance(raw, bool):
            raise TableError(where, f"must be one of {', '.join(map(str, args))}, got {raw!r}")
        return raw
    if tp is bool:
        if not isinstance(raw, bool):
            raise TableError(where, f"must be true or false, got {raw!r}")
        return raw
    if tp is int or tp is float:
        return _number(raw, tp is int, where, limits)
    if tp is str:
        if not isinstance(raw, str):
            raise TableError(where, f"must be a string, got {raw!r}")
        return raw
    if origin in (tuple, list, set, frozenset, Sequence):
        return _array(raw, origin, args, where, limits)
    if origin in (dict, Mapping):
        if not isinstance(raw, Mapping):
            raise TableError(where, f"must be a table, got {raw!r}")
        kt, vt = args or (Any, Any)
        return {convert(k, kt, where, None): convert(v, vt, f"{where}.{k}", limits) for k, v in raw.items()}
    if origin is not None and callable(origin) and origin.__module__ == "collections.abc":
        raise TableError(where, f"cannot be set from a table (a {origin.__name__})")
    raise TableError(where, f"cannot be set from a table (type {tp})")


def _union(raw: Any, members: tuple[Any, ...], where: str, limits: Range | None) -> Any:
    optional = type(None) in members
    if optional and (raw is None or raw == NONE):
        return None
    others = [m for m in members if m is not type(None)]
    problems = []
    for member in others:
        try:
            return convert(raw, member, where, limits)
        except TableError as exc:
            problems.append(exc.problem)
    tail = f' or "{NONE}"' if optional else ""
    if len(problems) == 1:
        problem = problems[0]
        if tail and ", got " in problem:
            head, got = problem.rsplit(", got ", 1)
            problem = f"{head}{tail}, got {got}"
        raise TableError(where, problem)
    raise TableError(where, f"{' | '.join(problems)}{tail}")


def _number(raw: Any, integer: bool, where: str, limits: Range | None) -> int | float:
    ok = not isinstance(raw, bool) and isinstance(raw, int if integer else int | float)
    ok = ok and (integer or math.isfinite(raw))
    ok = ok and (limits is None or limits.contains(raw))
    if not ok:
        what = (limits or Range()).describe(integer)
        hint = f"; {limits.hint}" if limits is not None and limits.hint else ""
        raise TableError(where, f"must be {what}, got {raw!r}{hint}")
    return raw if integer else float(raw)


def _array(raw: Any, origin: Any, args: tuple[Any, ...], where: str, limits: Range | None) -> Any:
    if isinstance(raw, tuple | set | frozenset):  # from Python rather than TOML
        raw = list(raw)
    if not isinstance(raw, list):
        raise TableError(where, f"must be an array, got {raw!r}")
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(raw) != len(args):
            raise TableError(where, f"must be an array of {len(args)} values, got {raw!r}")
        return tuple(convert(v, t, f"{where}[{i}]", limits) for i, (v, t) in enumerate(zip(raw, args)))
    element = args[0] if args else Any
    items = [convert(v, element, f"{where}[{i}]", limits) for i, v in enumerate(raw)]
    if origin is tuple:
        return tuple(items)
    if origin in (set, frozenset):
        return frozenset(items)
    return items


def _laid_over(base: Any, table: Any) -> Any:
    """`table` laid over `base` key by key, nested mappings too (a `merged` field)."""
    if not isinstance(base, Mapping) or not isinstance(table, Mapping):
        return table
    out = dict(base)
    for key, value in table.items():
        out[key] = _laid_over(base[key], value) if key in base else value
    return out


def _join(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def _field_key(section: str, cls: type, message: str) -> str:
    """``section.field`` when `message` names a field of `cls` (``ClassName.field ...``), else `section`."""
    names = set(keys(cls))
    for match in re.finditer(rf"\b{re.escape(cls.__name__)}\.(\w+)", message):
        if match.group(1) in names:
            return _join(section, match.group(1))
    return section
