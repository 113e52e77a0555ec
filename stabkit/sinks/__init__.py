"""Sinks write metrics and events out (TensorBoard, JSONL, console); they only read, never compute.

`SinkSet` (fanout.py) fans out to them and switches off one that fails (full disk, read-only
logdir) instead of stopping training; `rundir.py` picks the folder a run writes to, so two runs
never mix in one logdir.
"""

from __future__ import annotations

from .console import ConsoleSink, summary_line
from .fanout import Sink, SinkSet
from .jsonl import LOG_NAME, JsonlSink, read_jsonl
from .rundir import LOG_MODES, choose_logdir, clear_logs, run_folders
from .tensorboard import TensorBoardSink, custom_scalar_layout

__all__ = [
    "LOG_MODES",
    "LOG_NAME",
    "ConsoleSink",
    "JsonlSink",
    "Sink",
    "SinkSet",
    "TensorBoardSink",
    "choose_logdir",
    "clear_logs",
    "custom_scalar_layout",
    "read_jsonl",
    "run_folders",
    "summary_line",
]
