"""What the multi-process tests of this folder share: `torchrun` runs a worker script of
tests/dist_workers/ on N local CPU ranks (gloo) — each rank writes ``rank<r>.json`` into `out`, returned in
rank order (the worker's side: `dist_workers/entry.py`) — and `SPLIT_ROWS`, the statistics that are not
exact once the batch or sequence is split over ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

TESTS = Path(__file__).parents[1]
"""The tests/ folder (its parent, the repository root, goes on the workers' PYTHONPATH)."""
WORKERS = TESTS / "dist_workers"
SPLIT_ROWS = ("/min_head_entropy", "/first_key_mass", "/sink_heads", "/massive_dim", "/kurtosis")
"""Statistics that are not exact once the batch or the sequence is split over ranks (data parallel,
sequence parallel): minima and maxima over heads or channels of per-rank values, per-rank medians."""


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
