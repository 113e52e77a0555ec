"""Lazy public names for a package (PEP 562): ``__getattr__ = lazy_names(__name__, {name: submodule})``.

Runs when a name is first asked for; the submodule is imported then (so importing the package, and
the CLI's ``--help``, do not import torch or scipy).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_names(package: str, table: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that loads ``name`` from ``package.<table[name]>`` on first use."""

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f".{module}", package), name)

    return __getattr__
