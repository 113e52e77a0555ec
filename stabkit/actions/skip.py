"""Action 'skip': before the update, make the coming `optimizer.step()` a no-op.

Every gradient is set to None: torch optimizers (SGD, Adam, AdamW...) then leave those parameters
and their state untouched — parameters and optimizer state stay bitwise unchanged. After the update
(a loss spike is known only at `Monitor.step`) it cannot act; the event says so — use rollback there.
"""

from __future__ import annotations

from typing import Any

from ..events import Event
from ..plugins import ACTIONS
from .base import Action


def skip_update(optimizer: Any) -> None:
    """Make the coming `optimizer.step()` a no-op for every parameter (grads set to None)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


@ACTIONS.register
class Skip(Action):
    """Skip this step's update (before the update only)."""

    name = "skip"
    order = 30

    def run(self, event: Event, before_update: bool) -> bool:
        if before_update and self.ctx.optimizer is not None:
            return True
        event.details["skip"] = "not possible: the update of this step was already applied (use rollback)"
        return False
