"""The `stabkit` command line: thin click commands over the library."""

from . import (  # noqa: F401  (register commands)
    alarms_cmd,
    bench_cmd,
    demo_cmd,
    inspect_cmd,
    leadtime_cmd,
    list_cmd,
    report_cmd,
    run_cmd,
    scale_cmd,
    sweep_cmd,
)
from .app import UserInputError, main

__all__ = ["UserInputError", "main"]
