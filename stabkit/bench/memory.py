"""CPU memory overhead: peak resident set size of a fresh process per variant.

Runs once per variant as `python -m stabkit.bench.memory '<json BenchConfig>' <variant>`; the
parent compares each variant's peak RSS with the bare loop's. The child runs with glibc's mmap
threshold lowered (MALLOC_MMAP_THRESHOLD_), so freed tensors go back to the OS at once and the
peak RSS follows the peak of live memory instead of the allocator's caching. The peak is read
from /proc/self/status (VmHWM): `ru_maxrss` would report the parent's peak, inherited at fork.
Resolution is the process noise (the bare loop is measured twice to show it).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
from dataclasses import asdict
from typing import Any

import torch

MMAP_THRESHOLD = "16384"
"""Bytes above which glibc serves (and returns) allocations with mmap in the measuring child."""


def peak_rss_bytes() -> int:
    """This process's own peak resident set size (VmHWM on Linux; ru_maxrss elsewhere)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_in_subprocess(cfg: Any, variant: str) -> int:
    """Peak RSS in bytes of a fresh process that trains `variant` for warmup + steps steps."""
    payload = json.dumps({k: v for k, v in asdict(cfg).items() if k != "variants"})
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": MMAP_THRESHOLD, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "stabkit.bench.memory", payload, variant],
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
        env=env,
    )
    return int(proc.stdout.strip().splitlines()[-1])


def cpu_memory_overheads(cfg: Any) -> tuple[dict[str, int | None], int]:
    """(overhead per variant in bytes, noise = |bare − bare again|)."""
    bare = measure_in_subprocess(cfg, "bare")
    noise = abs(measure_in_subprocess(cfg, "bare") - bare)
    out: dict[str, int | None] = {"bare": 0}
    for v in cfg.variants:
        if v != "bare":
            out[v] = measure_in_subprocess(cfg, v) - bare
    return out, noise


def _warm_up(cfg: Any, tmp: str) -> None:
    """Train a throwaway copy of the measured model for two steps under the full-detail monitor, in
    every variant, so the libraries' one-time costs (imports, kernels' first use at these shapes)
    are the same everywhere and only the memory the monitoring keeps or adds during training differs."""
    from ..monitor import attach
    from .runner import BenchConfig, _Trainer, make_batches, monitor_config

    throwaway = _Trainer(BenchConfig(**{**vars(cfg), "seed": cfg.seed + 1}), make_batches(cfg, n=2))
    mcfg = monitor_config("full")
    assert mcfg is not None
    throwaway.monitor = attach(throwaway.model, throwaway.opt, logdir=tmp, config=mcfg)
    throwaway.run(2)
    throwaway.monitor.detach()


def _main(payload: str, variant: str) -> None:
    from ..monitor import attach
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
        trainer.run(cfg.warmup + cfg.steps, anomaly=variant == "anomaly")
        if trainer.monitor is not None:
            trainer.monitor.detach()
    print(peak_rss_bytes())


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
