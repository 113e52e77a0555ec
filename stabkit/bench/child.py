"""Run one bench variant in a fresh Python process (the memory and compile-time phases).

The child is ``python -m <module> '<json BenchConfig without variants>' <variant>``; it prints its
result as the last line of its stdout, which `run_variant_process` returns.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from typing import Any


def run_variant_process(module: str, cfg: Any, variant: str, env: dict[str, str], timeout: float) -> str:
    """The last stdout line of ``python -m module`` measuring `variant` of `cfg` (a BenchConfig), with
    `env` over this process's environment and one OpenMP thread; raises when the child fails."""
    payload = json.dumps({k: v for k, v in asdict(cfg).items() if k != "variants"})
    proc = subprocess.run(
        [sys.executable, "-m", module, payload, variant],
        capture_output=True,
        text=True,
        check=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )
    return proc.stdout.strip().splitlines()[-1]
