"""The fixed cost of monitoring: milliseconds a monitor adds to a sampled and to an unsampled step.

Ratios hide what a monitor costs per step: on a 50 ms step 0.5 ms is a point, on a 500 ms step a
tenth of one. Each timed step of a monitored variant is paired with bare's step at the same place
of the same round (in ``--paired`` mode the two ran next to each other), and the differences are
averaged separately over the variant's sampled steps (per-layer statistics taken,
``MonitorConfig.every``) and unsampled ones (only the every-step scalars: what stabkit costs on most
steps). The figure is the median over rounds; its noise the standard error over blocks of whole
monitor cycles when the rounds hold at least four (`stabkit.bench.noise`), else half the spread of the
rounds' values.

When it runs: once, after the timed rounds, to fill the table's "+ms" columns and the JSON.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from .noise import block_steps, blocks, half_spread, standard_error


class Steps(Protocol):
    """What `added_ms` reads of a variant (`stabkit.bench.runner.VariantResult`)."""

    monitored: bool
    step_cpu: list[list[float]]
    step_sampled: list[list[bool]]
    cycle: int


class Variants(Protocol):
    """What `added_ms` reads of a bench result (`stabkit.bench.runner.BenchResult`)."""

    @property
    def variants(self) -> Mapping[str, Steps]: ...


@dataclass(frozen=True)
class Added:
    """Milliseconds added per step of one kind (median over rounds) and their noise band."""

    ms: float
    noise: float | None
    """The standard error over blocks of whole cycles, else half the spread of the per-round values
    (None with a single short round)."""
    steps: int
    """Steps of this kind that were paired, over every round."""

    def text(self) -> str:
        band = "" if self.noise is None else f"±{self.noise:.2f}"
        return f"{self.ms:+.2f}{band}"


def added_ms(result: Variants, name: str) -> dict[str, Added | None]:
    """{'sampled': ..., 'unsampled': ...} for variant `name` (None for a kind it never ran, and for
    variants without a monitor: bare, anomaly, qk_clip)."""
    out: dict[str, Added | None] = {"sampled": None, "unsampled": None}
    variant, bare = result.variants[name], result.variants["bare"]
    if not variant.monitored:
        return out
    for kind, want in (("sampled", True), ("unsampled", False)):
        per_round: list[float] = []
        steps = 0
        for mine, base, flags in zip(variant.step_cpu, bare.step_cpu, variant.step_sampled, strict=False):
            diffs = [m - b for m, b, f in zip(mine, base, flags, strict=False) if f == want]
            if diffs:
                per_round.append(1e3 * statistics.fmean(diffs))
                steps += len(diffs)
        if per_round:
            noise = standard_error(_block_means(variant, bare, want))
            if noise is None:
                noise = half_spread(per_round)
            out[kind] = Added(statistics.median(per_round), noise, steps)
    return out


def _block_means(variant: Steps, bare: Steps, want: bool) -> list[float]:
    """Per block of whole cycles (`stabkit.bench.noise.blocks`): the milliseconds added on average over
    the block's steps of the kind `want` (sampled or not)."""
    lengths = [
        min(len(m), len(b), len(f))
        for m, b, f in zip(variant.step_cpu, bare.step_cpu, variant.step_sampled, strict=False)
    ]
    out: list[float] = []
    for r, steps in blocks(lengths, block_steps(variant.cycle)):
        mine, base, flags = (
            variant.step_cpu[r][steps],
            bare.step_cpu[r][steps],
            variant.step_sampled[r][steps],
        )
        diffs = [m - b for m, b, f in zip(mine, base, flags, strict=True) if f == want]
        if diffs:
            out.append(1e3 * statistics.fmean(diffs))
    return out
