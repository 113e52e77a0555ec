"""Benchmark: monitoring overhead against a bare loop (`stabkit bench`)."""

from .report import format_table
from .runner import VARIANTS, BenchConfig, BenchResult, run_bench

__all__ = ["VARIANTS", "BenchConfig", "BenchResult", "format_table", "run_bench"]
