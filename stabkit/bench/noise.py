"""The noise band of a variant's ratio to bare: how far the bench's figure could move on a rerun.

Each round gives one ratio (the variant's time over bare's in the same round). With two rounds — the
paired mode's usual ``--repeats 2`` — half their spread is the standard error of a mean of two values:
an estimate from two samples, which on a shared CPU said ±0.001 while reruns of the same code read
1.019–1.027 (small-step preset, default monitoring). When a round holds enough steps, the band comes
from blocks instead: each round is cut into consecutive blocks of whole monitor cycles (`cycle`), each
block gives the variant's time over bare's for the same steps, and the band is the standard error of
the mean of all blocks' ratios. A block of whole cycles holds every kind of step (sampled, whole-model,
the log interval's flush) in the same proportion wherever it starts, so the blocks differ only by the
machine's noise, not by which steps they hold.

When it runs: after the timed rounds, for the table's noise column, the time verdicts and the JSON.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from ..config import MonitorConfig

MIN_BLOCKS = 4
"""Fewest blocks the block estimate takes (fewer: the rounds' half spread)."""

MIN_BLOCK_STEPS = 10
"""Shortest block, in steps, for a variant whose work repeats every step (no monitor, every=1)."""


@dataclass(frozen=True)
class Band:
    """A ratio's noise band and what it was estimated from."""

    value: float
    blocks: int
    """Blocks the standard error is over (0: the rounds' half spread)."""
    block_steps: int
    """Steps per block (0 for the rounds' half spread)."""
    rounds: int

    def basis(self) -> str:
        """What the band is, in words (the table's footnote)."""
        if self.blocks:
            return f"standard error over {self.blocks} blocks of {self.block_steps} steps"
        return f"half the spread of {self.rounds} rounds"


def cycle(config: MonitorConfig | None) -> int:
    """Steps after which `config`'s monitor repeats its work: the least common multiple of its
    cadences (sampled steps, attention, whole-model statistics, log interval); 1 without a monitor."""
    if config is None:
        return 1
    return math.lcm(config.every, config.attention_every, config.deep_cadence, config.log_every)


def blocks(rounds: list[int], size: int) -> list[tuple[int, slice]]:
    """(round, steps) of each block of `size` consecutive steps of rounds `rounds` steps long (a
    round's last steps short of a block are left out)."""
    return [
        (r, slice(start, start + size))
        for r, n in enumerate(rounds)
        for start in range(0, n - size + 1, size)
    ]


def block_ratios(mine: list[list[float]], bare: list[list[float]], size: int) -> list[float]:
    """Per block of `size` consecutive steps of each round: the variant's seconds over bare's for the
    same steps."""
    out: list[float] = []
    for r, steps in blocks([min(len(m), len(b)) for m, b in zip(mine, bare, strict=False)], size):
        base = sum(bare[r][steps])
        if base > 0:
            out.append(sum(mine[r][steps]) / base)
    return out


def standard_error(values: list[float]) -> float | None:
    """The standard error of the mean of `values` (None for fewer than `MIN_BLOCKS`)."""
    if len(values) < MIN_BLOCKS:
        return None
    return statistics.stdev(values) / math.sqrt(len(values))


def block_steps(steps_per_cycle: int) -> int:
    """Steps per block for a variant whose monitor repeats every `steps_per_cycle` steps."""
    return max(steps_per_cycle, MIN_BLOCK_STEPS)


def band(
    round_ratios: list[float], mine: list[list[float]], bare: list[list[float]], steps_per_cycle: int
) -> Band | None:
    """The noise band of a ratio: the standard error over blocks of whole cycles when the rounds hold
    at least `MIN_BLOCKS` of them, else half the spread of `round_ratios` (None with one round)."""
    size = block_steps(steps_per_cycle)
    ratios = block_ratios(mine, bare, size)
    error = standard_error(ratios)
    if error is not None:
        return Band(error, len(ratios), size, len(round_ratios))
    spread = half_spread(round_ratios)
    return None if spread is None else Band(spread, 0, 0, len(round_ratios))


def half_spread(per_round: list[float]) -> float | None:
    """Half of (max − min) of per-round values: the band when the rounds are too short for blocks
    (None with a single round)."""
    return (max(per_round) - min(per_round)) / 2 if len(per_round) > 1 else None
