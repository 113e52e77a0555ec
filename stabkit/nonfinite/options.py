"""`NonfiniteOptions`: the settings of the 'nonfinite' kind (``DetectConfig.options["nonfinite"]``),
read by its plug-in face (`stabkit.nonfinite.kind`) and its device part (`stabkit.nonfinite.watch`).
Plain data: imports no torch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..tables import bounds

LossFn = Callable[..., Any]
"""`loss_fn(output, *args, **kwargs) -> scalar loss`: recomputes a step's loss from the model output and inputs."""


@dataclass(frozen=True)
class NonfiniteOptions:
    """``DetectConfig.options["nonfinite"]``."""

    check_output: bool = True
    """Check the model output for NaN/+Inf from its max (one read of the logits; finite iff log Z is
    finite), on the steps `output_check_every` says."""
    output_check_every: int | None = field(default=None, metadata=bounds(lo=1))
    """Check the output on every N-th step (None = every step when 'nonfinite' is decided per step —
    an action other than warn, or ``DetectConfig.sync`` — whose replay tells a broken output from a
    broken loss; else with the sampled statistics, every ``MonitorConfig.every`` steps: a warn-only
    run decides from its rows, whose loss and gradient norm, recorded every step, a non-finite output
    makes non-finite. 1: every step, as earlier 0.x versions did; ~0.1 ms a step on a CPU)."""
    optimizer_check_every: int | None = field(default=None, metadata=bounds(lo=0))
    """Check params + optimizer state for NaN/Inf after every N-th update (one read of both; 0 = off; None = every step when 'nonfinite' has an action other than warn, else with the whole-model statistics, every MonitorConfig.deep_every)."""
    localize: bool = True
    """On a decided non-finite step, replay it with per-module checks and name the module, pass and tensor that produced it."""
    keep_output_grad: bool = True
    """Keep dL/d(output) until the optimizer step so the backward pass can be replayed (one output-sized tensor; see loss_fn)."""
    loss_fn: LossFn | None = None
    """`loss_fn(output, *args, **kwargs) -> loss` for replaying the backward pass; when set, no output gradient is kept."""
    per_module: bool = False
    """Always-on mode: per-module finite checks (forward, backward, parameter grads) on every step; costly, no replay needed."""
