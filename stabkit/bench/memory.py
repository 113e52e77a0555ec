"""CPU memory overhead, measured in a fresh process per variant, two ways:

- *tensor memory* (what the budget is judged on, the CPU analogue of CUDA's max_memory_allocated):
  the peak of the torch profiler's memory timeline over a few profiled steps;
- *resident set size*: the process's peak RSS, which also counts Python objects (sinks, history,
  detector state) — shown beside it.

Runs once per variant as `python -m stabkit.bench.memory '<json BenchConfig>' <variant>`; the
parent compares each variant's peak RSS with the bare loop's. The child runs with glibc's mmap
threshold lowered (MALLOC_MMAP_THRESHOLD_), so freed tensors go back to the OS at once and the
peak RSS follows the peak of live memory instead of the allocator's caching. The peak is read
from /proc/self/status (VmHWM): `ru_maxrss` would report the parent's peak, inherited at fork.
Resolution is the process noise (the bare loop is measured twice to show it). The profiled steps
start on a sampled step (`MonitorConfig.every`), so the per-layer statistics' memory is counted.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from .child import run_variant_process

if TYPE_CHECKING:
    from .runner import Progress

MMAP_THRESHOLD = "16384"
"""Bytes above which glibc serves (and returns) allocations with mmap in the measuring child."""


def peak_rss_bytes() -> int:
    """This process's own peak resident set size (VmHWM on Linux; ru_maxrss elsewhere)."""
    try:
        with open(os.path.join(os.sep, "proc", "self", "status"), encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


PROFILED_STEPS = 3
"""Steps traced by the profiler for the tensor-memory peak."""


def peak_tensor_bytes(run_steps: Any, steps: int) -> int:
    """Peak bytes of live CPU tensors while `run_steps(steps)` runs (torch profiler memory timeline)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True
    ) as prof:
        run_steps(steps)
    with tempfile.TemporaryDirectory(prefix="stabkit-bench-timeline-") as tmp:
        path = os.path.join(tmp, "timeline.json")
        prof.export_memory_timeline(path, device="cpu")
        with open(path, encoding="utf-8") as fh:
            _, sizes = json.load(fh)[:2]
    return int(max((sum(row) for row in sizes), default=0))


def measure_in_subprocess(cfg: Any, variant: str) -> tuple[int, int]:
    """(peak RSS, peak tensor bytes) of a fresh process that trains `variant`."""
    env = {"MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD}
    rss, tensors = run_variant_process("stabkit.bench.memory", cfg, variant, env, timeout=1800).split()
    return int(rss), int(tensors)


def memory_plan(cfg: Any) -> list[str]:
    """The variant each fresh process measures, in order: bare twice (its noise), then the others."""
    return ["bare", "bare", *(v for v in cfg.variants if v != "bare")]


PROFILE_STEP_COST = 15
"""A profiled step (with stacks, then the memory-timeline export) costs about this many plain steps."""


class ProcessClock:
    """Estimates how long the memory processes left will take.

    A process costs a fixed part (start-up and imports, the throw-away warm-up, attaching) plus its
    steps at the variant's step time from the timed rounds, profiled steps counted
    `PROFILE_STEP_COST` times: ``seconds = fixed + work × step_time``. Fitted on the processes done
    so far: ``fixed`` alone while they all had the same step time, ``fixed`` and ``work`` by least
    squares once two differ. Before the first one ends, ``fixed`` is guessed as twice `startup`
    (this process's own import time).
    """

    def __init__(self, cfg: Any, step_seconds: Mapping[str, float], startup: float) -> None:
        self.plan = memory_plan(cfg)
        self.work = float(cfg.warmup + cfg.steps + PROFILE_STEP_COST * PROFILED_STEPS)
        self.step_seconds = dict(step_seconds)
        self.fixed = 2 * startup
        self.done: list[tuple[float, float]] = []

    def finished(self, variant: str, seconds: float) -> None:
        """Record the wall time of a process that measured `variant`, and refit."""
        self.done.append((self.step_seconds.get(variant, 0.0), seconds))
        xs, ys = [x for x, _ in self.done], [y for _, y in self.done]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        spread = sum((x - mx) ** 2 for x in xs)
        if spread > 0:
            slope = sum((x - mx) * (y - my) for x, y in self.done) / spread
            if slope > 0:
                self.work = slope
        self.fixed = max(0.0, my - self.work * mx)

    def seconds(self, variant: str) -> float:
        """Expected wall time of one process measuring `variant`."""
        return self.fixed + self.work * self.step_seconds.get(variant, 0.0)

    def remaining(self, done: int) -> float:
        """Seconds for the processes after the first `done` of the plan."""
        return sum(self.seconds(v) for v in self.plan[done:])


def cpu_memory_overheads(
    cfg: Any, progress: Progress | None = None, clock: ProcessClock | None = None
) -> dict[str, dict[str, int | None]]:
    """Per method ('tensor', 'rss'): overhead per variant in bytes, and 'noise' = |bare − bare again|.

    Runs the processes of `memory_plan` one after another; `progress.begin` / `update(1)` around
    each, `clock.finished` after each."""
    measured: list[tuple[int, int]] = []
    plan = memory_plan(cfg)
    for i, variant in enumerate(plan):
        if progress is not None:
            progress.begin(f"{variant} again (noise)" if variant == "bare" and i else variant)
        start = time.perf_counter()
        measured.append(measure_in_subprocess(cfg, variant))
        if clock is not None:
            clock.finished(variant, time.perf_counter() - start)
        if progress is not None:
            progress.update(1)
    bare, again_ = measured[0], measured[1]
    out: dict[str, dict[str, int | None]] = {
        "rss": {"bare": 0, "noise": abs(again_[0] - bare[0])},
        "tensor": {"bare": 0, "noise": abs(again_[1] - bare[1])},
    }
    for v, (rss, tensors) in zip(plan[2:], measured[2:]):
        out["rss"][v], out["tensor"][v] = rss - bare[0], tensors - bare[1]
    return out


def _warm_up(cfg: Any, tmp: str) -> None:
    """Train a throwaway copy of the measured model for two steps under the full-detail monitor, in
    every variant, so the libraries' one-time costs (imports, kernels' first use at these shapes)
    are the same everywhere and only the memory the monitoring keeps or adds during training differs."""
    from ..attaching import attach
    from .runner import BenchConfig, _Trainer, make_batches, monitor_config

    throwaway = _Trainer(BenchConfig(**{**vars(cfg), "seed": cfg.seed + 1}), make_batches(cfg, n=2))
    mcfg = monitor_config("full")
    assert mcfg is not None
    throwaway.monitor = attach(throwaway.model, throwaway.opt, logdir=tmp, config=mcfg)
    throwaway.run(2)
    throwaway.monitor.detach()


def _main(payload: str, variant: str) -> None:
    from ..attaching import attach
    from .interventions import apply_variant
    from .runner import BenchConfig, _Trainer, make_batches, monitor_config

    torch.set_num_threads(1)
    cfg = BenchConfig(**json.loads(payload))
    with tempfile.TemporaryDirectory(prefix="stabkit-bench-warm-") as warm:
        _warm_up(cfg, warm)
    trainer = _Trainer(cfg, make_batches(cfg))
    with tempfile.TemporaryDirectory(prefix="stabkit-bench-mem-") as tmp:
        mcfg = monitor_config(variant)
        if mcfg is not None:
            trainer.monitor = attach(trainer.model, trainer.opt, logdir=tmp, config=mcfg)
        handle = apply_variant(trainer.model, trainer.opt, variant)  # an intervention variant: qk_clip
        anomaly = variant == "anomaly"
        trainer.run(cfg.warmup + cfg.steps, anomaly=anomaly)
        if trainer.monitor is not None:  # profile from a sampled step: per-layer statistics count too
            trainer.run(-trainer.monitor.global_step % trainer.monitor.config.every, anomaly=anomaly)
        rss = peak_rss_bytes()  # before profiling: the profiler's own records would count
        tensors = peak_tensor_bytes(lambda n: trainer.run(n, anomaly=anomaly), PROFILED_STEPS)
        if trainer.monitor is not None:
            trainer.monitor.detach()
        if handle is not None:
            handle.remove()
    print(rss, tensors)


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
