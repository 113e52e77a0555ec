"""Benchmark: monitoring overhead against a bare loop (`stabkit bench`).

The names below load with their submodule on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .report import format_table
    from .runner import QUICK, VARIANTS, BenchConfig, BenchResult, run_bench

_LAZY = {
    "format_table": "report",
    "QUICK": "runner",
    "VARIANTS": "runner",
    "BenchConfig": "runner",
    "BenchResult": "runner",
    "run_bench": "runner",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'stabkit.bench' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


__all__ = ["QUICK", "VARIANTS", "BenchConfig", "BenchResult", "format_table", "run_bench"]
