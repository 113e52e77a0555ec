"""Which machine measured a bench run: platform, CPU model and count, torch and its thread count
(and the GPU on CUDA), for the table's header and the JSON — a ratio means little without them.

When it runs: once per bench run, after the timed rounds.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def cpu_model() -> str:
    """The CPU's model name (Linux: /proc/cpuinfo; else `platform.processor()`), or 'unknown CPU'."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.lower().startswith("model name"):
                return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def describe(device: str) -> dict[str, object]:
    """Machine, CPU, cores, torch version and intra-op threads (and the CUDA device's name)."""
    info: dict[str, object] = {
        "platform": f"{platform.system()} {platform.machine()}",
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__.split("+")[0],
        "threads": torch.get_num_threads(),
    }
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def line(info: dict[str, object]) -> str:
    """One line for the table: ``machine: Linux x86_64, <cpu> (2 CPUs), torch 2.x, 1 thread``."""
    threads = info.get("threads")
    gpu = f", {info['gpu']}" if info.get("gpu") else ""
    return (
        f"machine: {info.get('platform')}, {info.get('cpu')} ({info.get('cpus')} CPUs){gpu}, "
        f"torch {info.get('torch')}, {threads} thread{'' if threads == 1 else 's'}"
    )
