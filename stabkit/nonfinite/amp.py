"""The 'amp' kind: a step the fp16 GradScaler skipped (inf/NaN in the scaled gradients).

Reads ``amp/overflow`` (1 on a skipped step) and ``amp/scale`` (the loss scale after the step),
which the gradient probe records when `attach(..., scaler=...)` got an enabled GradScaler. A
skipped step is the scaler doing its job; the event says so. When the weights themselves are
broken (every step then overflows), that is reported as 'nonfinite' instead — by its device part,
`stabkit.nonfinite.scaler.ScalerCheck` (with a scaler only; it runs even when the 'nonfinite' kind
is off) — and this event is dropped (`quiet_after`). Importing it loads no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from ..detectors.advice import Advice
from ..detectors.base import Detector, Observation
from ..detectors.device import DeviceChecks, DeviceContext
from ..events import Event
from ..plugins import DETECTORS


@DETECTORS.register
class AmpDetector(Detector):
    """An event for each step the GradScaler skipped."""

    kind = "amp"
    watches = ("amp/overflow", "amp/scale")
    quiet_after = ("nonfinite",)
    advice: ClassVar[dict[str, Advice]] = {
        "amp_overflow": Advice(
            "the fp16 GradScaler skipped a step",
            (),
            "nothing if rare; if frequent, bf16 autocast or a lower LR",
        ),
    }

    def observe(self, step: int, values: Mapping[str, float]) -> Observation:
        """An event when ``amp/overflow`` is set."""
        if values.get("amp/overflow", 0.0) <= 0:
            return Observation()
        scale = values.get("amp/scale", float("nan"))
        return Observation(
            [
                Event(
                    step,
                    self.kind,
                    "amp/overflow",
                    scale,
                    0.0,
                    f"GradScaler skipped this step: inf/NaN in the scaled fp16 gradients (loss scale now {scale:g}); "
                    "this is the scaler doing its job, not a NaN in the model",
                    severity="info",
                )
            ]
        )

    def device_checks(self, ctx: DeviceContext) -> DeviceChecks | None:
        """With an fp16 GradScaler: `ScalerCheck` (on a skipped step, are the weights broken?)."""
        if not ctx.scaled:
            return None
        from .scaler import ScalerCheck

        return ScalerCheck(ctx.model, ctx.optimizer, ctx.facts)
