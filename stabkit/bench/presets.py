"""The models `stabkit bench` times: the reference GPT's presets, and bench-only shapes built on them.

``small-step`` is the shape where stabkit's fixed per-step cost shows: `small`'s width and depth
(d 128, 4 layers) on 8 sequences of 64 tokens (512 tokens a step, a quarter of `small`'s 2048), with
RoPE and dropout 0.1 — the loop a new user writes first. A step is ~50–60 ms on one CPU thread,
so each 0.5 ms stabkit spends per step is a point of the ratio.

When it runs: read once per bench run (and in each memory / compile child process) to build the
model and its batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..harness.models import PRESET_BATCH, PRESETS, GPTConfig, preset_config


@dataclass(frozen=True)
class BenchPreset:
    """A bench shape: the reference GPT preset it widens or shortens, with what it changes."""

    base: str
    """The `stabkit.harness.models.PRESETS` entry it starts from."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """GPTConfig fields changed from the base preset."""
    batch: int = 16
    """Sequences per step."""


BENCH_PRESETS: dict[str, BenchPreset] = {
    "small-step": BenchPreset("small", {"context": 64, "positions": "rope", "dropout": 0.1}, batch=8),
}
"""Bench-only shapes (name -> `BenchPreset`), offered beside the reference GPT's presets."""


def bench_sizes() -> tuple[str, ...]:
    """Every size `stabkit bench --size` takes: the reference GPT's presets, then the bench's own."""
    return (*PRESETS, *BENCH_PRESETS)


def size_config(size: str, **overrides: Any) -> GPTConfig:
    """The GPTConfig of bench size `size` with `overrides` applied (unknown names raise ValueError)."""
    shape = BENCH_PRESETS.get(size)
    if shape is None:
        return preset_config(size, **overrides)
    return preset_config(shape.base, **{**shape.overrides, **overrides})


def size_batch(size: str) -> int:
    """Sequences per step of bench size `size`."""
    shape = BENCH_PRESETS.get(size)
    return PRESET_BATCH[size] if shape is None else shape.batch
