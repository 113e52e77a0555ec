"""Run many corpus runs side by side: spawned worker processes with one torch thread each (or this
process, one after another, with ``workers <= 1``). Called once per `stabkit alarms` / script run;
results come back as plain dicts (`RunOutcome.to_dict`) in completion order through `on_result`.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from typing import Any

import torch

from .corpus import HealthyConfig
from .runner import Spike, run_config


@dataclass(frozen=True)
class CorpusJob:
    """One run: a config, its length, planted spikes and monitor mode (None: the config's own)."""

    config: HealthyConfig
    steps: int | None = None
    spikes: tuple[Spike, ...] = ()
    monitor: str | None = None

    @property
    def label(self) -> str:
        planted = "+" + ",".join(f"{s.step}x{s.factor:g}" for s in self.spikes) if self.spikes else ""
        mode = f"[{self.monitor}]" if self.monitor else ""
        return f"{self.config.name}{mode}{planted}"


def _init_worker() -> None:
    torch.set_num_threads(1)


def run_job(job: CorpusJob) -> dict[str, Any]:
    """One job's outcome as a dict, with its label and whether it was planted."""
    out = run_config(job.config, steps=job.steps, spikes=job.spikes, monitor=job.monitor).to_dict()
    out["label"] = job.label
    return out


def run_jobs(
    jobs: Sequence[CorpusJob],
    workers: int = 2,
    on_result: Callable[[CorpusJob, dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every job's outcome, in the order of `jobs` (`on_result` sees each as soon as it ends)."""
    deliver = on_result or (lambda job, res: None)
    results: dict[int, dict[str, Any]] = {}
    if workers <= 1 or len(jobs) <= 1:
        torch.set_num_threads(1)
        for i, job in enumerate(jobs):
            results[i] = run_job(job)
            deliver(job, results[i])
        return [results[i] for i in range(len(jobs))]
    # longest first (depth × steps), so the pool does not end waiting on one 24-layer run
    order = sorted(range(len(jobs)), key=lambda i: -_cost(jobs[i]))
    with ProcessPoolExecutor(
        min(workers, len(jobs)), mp_context=mp.get_context("spawn"), initializer=_init_worker
    ) as ex:
        futures = {ex.submit(run_job, jobs[i]): i for i in order}
        for f in as_completed(futures):
            i = futures[f]
            try:
                results[i] = f.result()
            except Exception as exc:  # the worker died: record it, keep the rest
                results[i] = {"name": jobs[i].config.name, "label": jobs[i].label, "error": f"{type(exc).__name__}: {exc}",
                              "events": [], "losses": [], "steps": 0, "spikes": [], "wall_s": 0.0}  # fmt: skip
            deliver(jobs[i], results[i])
    return [results[i] for i in range(len(jobs))]


def _cost(job: CorpusJob) -> float:
    c = job.config
    return c.depth * c.width * c.batch * c.seq * c.accum * (job.steps or c.steps)
