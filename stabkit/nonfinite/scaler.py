"""`ScalerCheck`: the device part of the 'amp' kind, with an fp16 GradScaler only.

On a step the GradScaler skipped, whether a parameter or optimizer state (not just a scaled
gradient) holds NaN/Inf — then every step overflows and the scale alone cannot help, which is
reported as a 'nonfinite' event naming the tensor. Runs at `Monitor.step` (`decide_step`), whatever
the 'nonfinite' kind's own settings (it comes with ``attach(..., scaler=...)``, detectors or not);
syncs once, on overflowed steps only.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..detectors.device import DeviceChecks
from ..events import Event
from ..stats.step_facts import StepFacts
from .localize import nonfinite_state


class ScalerCheck(DeviceChecks):
    """On a skipped fp16 step: the 'nonfinite' event of a broken model, else nothing."""

    kind = "nonfinite"

    def __init__(self, model: nn.Module, optimizer: Any, facts: StepFacts) -> None:
        self.model = model
        self.optimizer = optimizer
        self.facts = facts

    def decide_step(self, step: int, flagged: list[str]) -> Event | None:
        """The 'nonfinite' event of a broken model behind a skipped step, else None."""
        if not self.facts.update_skipped:
            return None
        found = nonfinite_state(self.model, self.optimizer)
        if found is None:
            return None
        return Event(
            step,
            "nonfinite",
            found.module or "(model)",
            float("nan"),
            0.0,
            f"{found.tensor} holds NaN/Inf: the GradScaler skips every step because the weights (or the "
            "optimizer state) are broken, not because the loss scale is too high",
            details={"pass": "optimizer", "module": found.module, "tensor": found.tensor},
            severity="critical",
        )
