"""Compile time of each compiled variant (`stabkit bench --compile`), cold, in a fresh process.

Runs once per variant as `python -m stabkit.bench.compiled '<json BenchConfig>' <variant>`, with a
fresh, empty Inductor cache directory (``TORCHINDUCTOR_CACHE_DIR``) and one compile thread, so each
variant pays what a new run pays — no kernel compiled by another variant is reused — and the C++
compiler runs as child processes of this one. The figure is CPU seconds (this process and its
reaped children: immune to other load on a shared machine, as the bench's step times are) of the
first steps, which compile every graph of the variant (step 0 is sampled, step 1 is not), less
the CPU time those steps take once compiled. The child also reports the graphs compiled and the
graph breaks met (Dynamo's counters). The bare loop is measured twice: the difference is the noise.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .child import run_variant_process

if TYPE_CHECKING:
    from .runner import BenchResult, Progress

COMPILE_STEPS = 2
"""Steps that compile every graph of a bench variant: a sampled step (0) and an unsampled one (1)."""
STEADY_STEPS = 3
"""Compiled steps timed after those, to take their own cost out of the compile time."""
METHOD = (
    "fresh process per variant, empty Inductor cache, one compile thread; CPU seconds of the steps "
    "that compile every graph (process + compiler children), less their compiled step time"
)


def cpu_seconds() -> float:
    """CPU seconds of this process and of its reaped children (the C++ compiler runs)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def compile_plan(cfg: Any) -> list[str]:
    """The variant each fresh process measures, in order: bare twice (its noise), then the others."""
    return ["bare", "bare", *(v for v in cfg.variants if v != "bare")]


def measure_in_subprocess(cfg: Any, variant: str) -> dict[str, Any]:
    """{'compile_s', 'graphs', 'breaks'} of a fresh process that compiles and trains `variant`."""
    with tempfile.TemporaryDirectory(prefix="stabkit-bench-inductor-") as cache:
        env = {"TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        line = run_variant_process("stabkit.bench.compiled", cfg, variant, env, timeout=3600)
    result: dict[str, Any] = json.loads(line)
    return result


def measure_compile(
    cfg: Any,
    result: BenchResult,
    progress: Progress | None = None,
    finished: Callable[[str, float], None] | None = None,
) -> None:
    """Fill each variant's `compile_s` (and the bare noise) in `result`, one fresh process per entry
    of `compile_plan`; `progress.begin` / `update(1)` around each, `finished(variant, wall s)` after."""
    import time

    plan = compile_plan(cfg)
    seconds: dict[str, float] = {}
    for i, variant in enumerate(plan):
        if progress is not None:
            progress.begin(f"{variant} again (noise)" if variant == "bare" and i else variant)
        start = time.perf_counter()
        measured = measure_in_subprocess(cfg, variant)
        if finished is not None:
            finished(variant, time.perf_counter() - start)
        if variant == "bare" and i:
            result.compile_noise = abs(measured["compile_s"] - seconds["bare"])
        else:
            seconds[variant] = measured["compile_s"]
        if progress is not None:
            progress.update(1)
    for name, value in seconds.items():
        if name in result.variants:
            result.variants[name].compile_s = value
    result.compile_method = METHOD


def _main(payload: str, variant: str) -> None:
    import torch

    from ..attaching import attach
    from .runner import BenchConfig, _Trainer, dynamo_counts, make_batches, monitor_config

    torch.set_num_threads(1)
    cfg = BenchConfig(**json.loads(payload))
    trainer = _Trainer(cfg, make_batches(cfg))
    with tempfile.TemporaryDirectory(prefix="stabkit-bench-compile-") as tmp:
        mcfg = monitor_config(variant)
        if mcfg is not None:
            trainer.monitor = attach(trainer.model, trainer.opt, logdir=tmp, config=mcfg)
        start = cpu_seconds()
        trainer.run(COMPILE_STEPS)
        compiling = cpu_seconds() - start
        graphs, breaks = dynamo_counts()
        start = cpu_seconds()
        trainer.run(STEADY_STEPS)
        steady = (cpu_seconds() - start) / STEADY_STEPS
        if trainer.monitor is not None:
            trainer.monitor.detach()
    out = {"compile_s": max(0.0, compiling - COMPILE_STEPS * steady), "graphs": graphs, "breaks": breaks}
    print(json.dumps(out))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
