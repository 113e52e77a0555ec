"""`Job`: what one worker trains (a variant of a recipe, maybe at another peak LR), and the
`Progress` callback it reports to. Plain data: built by the runner, sent to a pool worker."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..spec.recipe import Recipe

Progress = Callable[[str, str, int, int, float], None]
"""progress(run, status, step, total, loss); status in start, step, done, failed, interrupted."""


@dataclass
class Job:
    """What one worker trains: a variant of a recipe, optionally at another peak LR (sweeps)."""

    recipe: Recipe
    variant: str
    logdir: str
    device: str = "cpu"
    lr: float | None = None
    """Peak LR override (LR sweeps); None keeps the variant's."""
    run: str = ""
    """Display name (default: the variant)."""
    history_checks: list[tuple[str, str]] = field(default_factory=list)
    """(agg, metric pattern) pairs of monitored series the criteria read."""
    ddp: bool = False
    """Train on every rank of the running process group with DDP (`stabkit run --nproc N`): every
    rank runs this job at the same time, each on its rows of the global batch."""

    @property
    def name(self) -> str:
        return self.run or self.variant
