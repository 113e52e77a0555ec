"""CPU memory overhead: peak resident set size of a fresh process per variant.

Runs once per variant as `python -m stabkit.bench.memory '<json BenchConfig>' <variant>`; the
parent compares each variant's peak RSS with the bare loop's. Resolution is the process noise
(the bare loop is measured twice to show it).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
from dataclasses import asdict
from typing import Any

import torch


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_in_subprocess(cfg: Any, variant: str) -> int:
    """Peak RSS in bytes of a fresh process that trains `variant` for warmup + steps steps."""
    payload = json.dumps({k: v for k, v in asdict(cfg).items() if k != "variants"})
    proc = subprocess.run(
        [sys.executable, "-m", "stabkit.bench.memory", payload, variant],
        capture_output=True,
        text=True,
        check=True,
        timeout=1800,
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


def _main(payload: str, variant: str) -> None:
    from ..monitor import attach
    from .runner import BenchConfig, _Trainer, make_batches, monitor_config

    torch.set_num_threads(1)
    cfg = BenchConfig(**json.loads(payload))
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
