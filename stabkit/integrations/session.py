"""`Session`: what the framework callbacks share — attach once, one `Monitor.step` per optimizer
step with the loss of that step, detach at the end.

A framework callback calls `start` when training begins (model and optimizer exist), `add_loss`
for each micro-batch's loss it sees, `step` once per optimizer step, and `stop` when training
ends (normally or not). Losses stay on the device: `step` sums or averages them without a sync.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..attaching import attach
from ..monitor import Monitor


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside a framework wrapper (accelerate's AcceleratedOptimizer,
    Lightning's LightningOptimizer), or `optimizer` itself; None stays None."""
    seen = 0
    while optimizer is not None and not type(optimizer).__module__.startswith("torch.") and seen < 4:
        inner = getattr(optimizer, "optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer):
            break
        optimizer, seen = inner, seen + 1
    return optimizer


class Session:
    """One monitored training run inside a framework (see module notes)."""

    def __init__(self, logdir: str | Path | None, attach_options: dict[str, Any]) -> None:
        self.logdir = logdir
        self.attach_options = attach_options
        self.monitor: Monitor | None = None
        """The Monitor of the current run, or of the last one once it ended (detached; its `history`,
        `events` and `metrics` stay readable)."""
        self.live = False
        self._losses: list[torch.Tensor] = []
        self._sum = False

    def start(
        self,
        model: nn.Module,
        optimizer: Any,
        default_logdir: str | Path,
        schedule: dict[str, Any] | None = None,
    ) -> Monitor:
        """Attach (detectors come with `MonitorConfig.detect`). Called once, when training begins.
        `schedule`: the run's ``lr`` / ``warmup_steps`` as the framework knows them (for the audit and
        the detectors; what the user passed in the attach options wins)."""
        self.stop()
        logdir = self.logdir if self.logdir is not None else default_logdir
        options = {**(schedule or {}), **self.attach_options}
        self.monitor = attach(model, inner_optimizer(optimizer), logdir=logdir, **options)
        self.live = True
        return self.monitor

    def add_loss(self, loss: Any, summed: bool = False) -> None:
        """Keep one micro-batch's loss (device tensor or number); `summed`: the step's loss is the
        sum of its micro-batch losses (each already divided by the step's item count), else the mean."""
        if not self.live or loss is None:
            return
        value = (
            loss.detach().float().reshape(()) if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        )
        self._losses.append(value)
        self._sum = summed

    def step(self) -> None:
        """Close one optimizer step: `Monitor.step` with the loss of its micro-batches (if any)."""
        if not self.live or self.monitor is None:
            return
        loss: torch.Tensor | None = None
        if self._losses:
            device = self._losses[0].device
            stacked = torch.stack([v.to(device) for v in self._losses])
            loss = stacked.sum() if self._sum else stacked.mean()
        self._losses = []
        self.monitor.step(loss)

    def stop(self, crashed: bool = False) -> None:
        """Detach (flush, close the sinks). Safe to call twice.
        `crashed`: training ended with an exception — no collectives (other ranks may be gone)."""
        if self.live and self.monitor is not None:
            if crashed:
                self.monitor.close_on_crash()
            else:
                self.monitor.detach()
        self.live = False
        self._losses = []
