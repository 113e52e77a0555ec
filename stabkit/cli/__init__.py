"""The `stabkit` command line: thin click commands over the library."""

from . import bench_cmd, demo_cmd, inspect_cmd, list_cmd, report_cmd, run_cmd, sweep_cmd  # noqa: F401  (register commands)
from .app import UserInputError, main

__all__ = ["UserInputError", "main"]
