"""Lazy public names for a package (PEP 562), the one mechanism stabkit uses for them:

    __getattr__, __dir__ = lazy(__name__, {name: submodule}, submodules=(...))

Runs when a name is first asked for: the submodule is imported then, and the value kept as a plain
attribute of the package (the next access does not come here). So importing a package, and the
CLI's ``--help`` and ``list``, do not import torch or scipy. `lazy_names` is the ``__getattr__``
alone.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def lazy(
    package: str, table: Mapping[str, str], submodules: Iterable[str] = ()
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A module ``__getattr__`` that loads ``name`` from ``package.<table[name]>`` (or, for a name in
    `submodules`, the subpackage ``package.<name>`` itself) on first use, and a ``__dir__`` that lists
    them with the package's own names."""
    subs = frozenset(submodules)

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is not None:
            value = getattr(importlib.import_module(f".{module}", package), name)
        elif name in subs:
            value = importlib.import_module(f".{name}", package)
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        own = vars(sys.modules[package])
        return sorted({*own, *own.get("__all__", ()), *table, *subs})

    return __getattr__, __dir__


def lazy_names(
    package: str, table: Mapping[str, str], submodules: Iterable[str] = ()
) -> Callable[[str], Any]:
    """`lazy`'s ``__getattr__`` alone: ``__getattr__ = lazy_names(__name__, {name: submodule})``."""
    return lazy(package, table, submodules)[0]
