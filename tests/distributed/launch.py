"""What the multi-process tests of this folder share: `torchrun` runs a worker script of
tests/dist_workers/ on N local CPU ranks (gloo) — each rank writes ``rank<r>.json`` into `out`, returned in
rank order (the worker's side: `dist_workers/entry.py`) —, `SPLIT_ROWS`, the statistics that are not
exact once the batch or sequence is split over ranks, and the comparison of a parallel run's logged
history with one process's (`worst_errors`, `one_writer`).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

TESTS = Path(__file__).parents[1]
"""The tests/ folder (its parent, the repository root, goes on the workers' PYTHONPATH)."""
WORKERS = TESTS / "dist_workers"
SPLIT_ROWS = ("/min_head_entropy", "/first_key_mass", "/sink_heads", "/massive_dim", "/kurtosis")
"""Statistics that are minima, maxima or moments over heads or channels of per-rank values: made
exact across ranks from their parts (`stabkit/probes/split_exact.py`); `worst_errors(split=True)` still
leaves them out where a test asks (the torchtitan test under sequence parallel, not run without torchtitan)."""


def torchrun(
    worker: Path, scenario: str, out: Path, nproc: int = 2, timeout: float = 150.0
) -> list[dict[str, Any]]:
    """Run `worker scenario out` on `nproc` ranks; each rank's JSON result. A hung worker dumps its
    stack and exits 30 s before `timeout` (``STABKIT_TEST_HANG_S``)."""
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STABKIT_TEST_HANG_S": str(timeout - 30)}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    proc = subprocess.run(
        [*cmd, str(worker), scenario, str(out)], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def relative_error(got: float, want: float, floor: float = 1e-12) -> float:
    """|got − want| / max(|want|, floor); 0 when both are NaN, inf when only one is."""
    if math.isnan(want) or math.isnan(got):
        return 0.0 if math.isnan(want) and math.isnan(got) else math.inf
    return abs(got - want) / max(abs(want), floor)


def statistic_floor(name: str) -> float:
    """The relative error's floor: an excess kurtosis near 0 (a difference of two numbers near 3) is
    compared against 0.1, everything else against its own size."""
    return 1e-1 if name.endswith("/kurtosis") else 1e-12


def worst_errors(
    got_history: list[Any],
    want_history: list[Any],
    steps: int,
    split: bool,
    tolerance: Callable[[str], float],
    floor: Callable[[str], float] = statistic_floor,
) -> dict[str, float]:
    """Every statistic of a parallel run's history (rank 0's ``[step, values]`` rows) against one
    process's: the same steps and names, each within `tolerance(name)` relative error (`SPLIT_ROWS`
    skipped when `split`); returns the largest error per kind (``family/statistic``)."""
    got = {int(s): v for s, v in got_history}
    want = {int(s): v for s, v in want_history}
    assert sorted(got) == sorted(want) == list(range(steps))
    worst: dict[str, float] = {}
    for step, ref in want.items():
        assert set(got[step]) == set(ref), (step, set(ref) ^ set(got[step]))
        for name, value in ref.items():
            if split and name.endswith(SPLIT_ROWS):
                continue
            err = relative_error(got[step][name], value, floor(name))
            assert err <= tolerance(name), (step, name, got[step][name], value)
            kind = name.split("/")[0] + "/" + name.rsplit("/", 1)[-1]
            worst[kind] = max(worst.get(kind, 0.0), err)
    return worst


def one_writer(logdir: Path, steps: int) -> None:
    """Rank 0 alone wrote: one TensorBoard file, each step logged once."""
    from stabkit.sinks import read_jsonl

    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1
    logged = [r["step"] for r in read_jsonl(logdir / "stabkit.jsonl") if r["type"] == "metrics"]
    assert logged == list(range(steps))
