"""Benchmark: monitoring overhead against a bare loop (`stabkit bench`).

The names below load with their submodule on first use (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_names

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


__getattr__ = lazy_names(__name__, _LAZY)


__all__ = ["QUICK", "VARIANTS", "BenchConfig", "BenchResult", "format_table", "run_bench"]
