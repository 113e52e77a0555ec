"""Sinks write metrics and events out (TensorBoard, JSONL, console, and the experiment trackers
Weights & Biases and MLflow); they only read, never compute.

`SinkSet` (fanout.py) fans out to them and switches off one that fails (full disk, read-only
logdir, a tracker unreachable or not installed) instead of stopping training; `rundir.py` picks the
folder a run writes to, so two runs never mix in one logdir. The trackers (`wandb_sink.py`,
`mlflow_sink.py`, what they share in `trackers.py`) import their package only when switched on.
"""

from __future__ import annotations

from .console import ConsoleSink, summary_line
from .fanout import Sink, SinkSet
from .jsonl import LOG_NAME, JsonlSink, read_jsonl
from .mlflow_sink import MlflowSink
from .reader import Run, Series, load_run, load_runs, run_paths
from .rundir import LOG_MODES, choose_logdir, clear_logs, run_folders
from .tensorboard import TensorBoardSink, custom_scalar_layout
from .trackers import TrackerError
from .wandb_sink import WandbSink

__all__ = [
    "LOG_MODES",
    "LOG_NAME",
    "ConsoleSink",
    "JsonlSink",
    "MlflowSink",
    "Run",
    "Series",
    "Sink",
    "SinkSet",
    "TensorBoardSink",
    "TrackerError",
    "WandbSink",
    "choose_logdir",
    "clear_logs",
    "custom_scalar_layout",
    "load_run",
    "load_runs",
    "read_jsonl",
    "run_folders",
    "run_paths",
    "summary_line",
]
