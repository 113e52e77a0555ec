"""Named sizes of the reference GPT, from a CPU-tiny model to ~1 B parameters for a GPU.

`tiny` is the CPU proxy of ``shared/reference/papers.md`` (d 64, 2 layers, 4 heads, T 64,
~100 k non-embedding parameters, ~45 ms/step with one thread); `tiny-moe` is tiny with a mixture of
8 experts, top-2, in every block (`stabkit.harness.models.moe`, the ``moe-router-collapse`` recipe).
"""

from __future__ import annotations

from typing import Any

from .config import GPTConfig

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, context=64),
    "tiny-moe": dict(d_model=64, n_layers=2, n_heads=4, context=64, n_experts=8, top_k=2),
    "small": dict(d_model=128, n_layers=4, n_heads=4, context=128),
    "gpt2": dict(d_model=768, n_layers=12, n_heads=12, context=1024),
    "1b": dict(d_model=2048, n_layers=18, n_heads=16, context=1024),
}
"""Preset name -> GPTConfig fields. Vocabulary is 256 (bytes) unless overridden."""

PRESET_BATCH: dict[str, int] = {"tiny": 16, "tiny-moe": 16, "small": 16, "gpt2": 32, "1b": 16}
"""Default batch size per preset (sequences of `context` tokens)."""


def preset_config(name: str, **overrides: Any) -> GPTConfig:
    """The GPTConfig of preset `name` with `overrides` applied; unknown names raise ValueError."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return GPTConfig(**PRESETS[name]).updated(**overrides)
