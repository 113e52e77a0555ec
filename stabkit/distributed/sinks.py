"""Only rank 0 writes: the sinks each rank gets at `attach` (files, console, W&B, MLflow), and the
host-side finishing of rows.

Statistics and the events decided from them (spikes, drift, agreed non-finite steps) are the
same on every rank after the reduction, so rank 0's files say it all. A non-finite step is
*localized* on the rank that saw it (replay, per-module checks): other ranks print their
non-finite events to stderr, prefixed with their rank, so that finding is not lost.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, TextIO

from ..config import MonitorConfig
from ..events import Event
from ..sinks import SinkSet
from ..sinks.trackers import run_params
from .context import DistContext

RATIO_PARTS = (".num", ".den")
"""Suffixes of the numerator ‖Δθ‖ and denominator ‖θ‖ of an update ratio (`update/<unit>/ratio`,
`update/global_ratio`), recorded separately under FSDP2 (each an 'l2' norm of shards) and
divided after the reduction."""


class RankEventEcho:
    """Sink of a rank other than 0: prints its non-finite events to stderr; writes nothing else."""

    def __init__(self, rank: int, stream: TextIO | None = None) -> None:
        self.rank = rank
        self.stream = stream

    def write_metrics(self, step: int, values: dict[str, float]) -> None:
        """Metrics are written by rank 0."""

    def write_event(self, event: Event) -> None:
        if event.kind == "nonfinite":
            print(f"[stabkit rank {self.rank}] {event}", file=self.stream or sys.stderr, flush=True)

    def write_record(self, kind: str, data: dict[str, Any]) -> None:
        """Records are for the JSONL log: nothing to do here."""

    def write_text(self, tag: str, text: str, step: int = 0) -> None:
        """Texts are written by rank 0."""

    def flush(self) -> None:
        (self.stream or sys.stderr).flush()

    def close(self) -> None:
        self.flush()


def rank_sinks(logdir: str | Path | None, config: MonitorConfig, ctx: DistContext) -> SinkSet:
    """The sinks of this rank (built at `attach`): all of them on the writing rank — the file sinks
    in the folder `MonitorConfig.logdir_mode` picks (`SinkSet.logdir`), the experiment trackers
    (`MonitorConfig.wandb`, `.mlflow`) switched on — and an event echo on the others (one W&B or
    MLflow run per job, under DDP, FSDP2 and tensor parallelism alike)."""
    if ctx.writes:
        sinks = SinkSet(
            logdir, config.tensorboard, config.jsonl, config.console, config.logdir_mode, config.strict
        )
        sinks.write_record("config", run_params(config))  # for `stabkit.load_run`; trackers get it their way
        sinks.add_trackers(config, logdir)
        return sinks
    sinks = SinkSet(None, tensorboard=False, jsonl=False, console=False)
    if config.console:
        sinks.files.append(RankEventEcho(ctx.rank))
    return sinks


def finish_ratios(rows: list[tuple[int, dict[str, float]]]) -> None:
    """Replace each `update/...ratio.num` and `.den` pair by the ratio num / den, in place, after
    the cross-rank reduction (runs at the log interval, on the host)."""
    num_suffix, den_suffix = RATIO_PARTS
    for _, row in rows:
        for key in [k for k in row if k.startswith("update/") and k.endswith(num_suffix)]:
            name = key[: -len(num_suffix)]
            num = row.pop(key)
            den = row.pop(name + den_suffix, None)
            if den is not None:
                row[name] = num / max(den, 1e-12)
