"""The 'nonfinite' kind: NaN/Inf in the loss, gradients, model output, parameters or optimizer state.

Its events are decided by its device part (`stabkit.nonfinite.watch.NonfiniteWatch`: the step guard
on the model output, the global gradient norm, the fused parameter / optimizer-state check, the
per-module tracer and the replay that names the module), because finding the *producer* needs the
model; `device_checks` (the detectors' extension point, `stabkit.detectors.device`) builds it at
attach. This class is the kind's plug-in face: its options (`NonfiniteOptions`, in `options.py`
beside it), its advice rows and which row fits an event. Importing it loads no torch (the device
part is imported when it is built).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import ClassVar

from ..detectors.advice import Advice
from ..detectors.base import Detector, DetectorContext, Observation
from ..detectors.device import DeviceChecks, DeviceContext
from ..events import Event
from ..plugins import DETECTORS
from .options import NonfiniteOptions


@DETECTORS.register
class NonfiniteDetector(Detector):
    """Advice for non-finite events (decided on the device by `stabkit.nonfinite.watch.NonfiniteWatch`)."""

    kind = "nonfinite"
    options_class = NonfiniteOptions
    advice: ClassVar[dict[str, Advice]] = {
        "nonfinite_attention": Advice(
            "NaN/Inf produced inside attention",
            ("qk_norm", "attn_softcap", "qk_clip"),
            "attention logits overflowed the softmax: normalise q and k, soft-cap the logits or clip the heads past a threshold (QK-Clip); keep the softmax in float32",
        ),
        "nonfinite_output": Advice(
            "NaN/Inf at the output head / log Z",
            ("z_loss", "logit_softcap"),
            "output logits overflowed: z-loss keeps log Z near 0, a logit soft cap (30) bounds the logits",
        ),
        "nonfinite_norm": Advice(
            "NaN/Inf produced by a norm layer",
            (),
            "compute the norm in float32 and check its eps; non-finite weights came from an earlier update (rollback)",
        ),
        "nonfinite_forward": Advice(
            "NaN/Inf produced by a module in the forward pass",
            (),
            "check the module for overflow under bf16/fp16 (autocast), log/div/sqrt of non-positive values, and its weights",
        ),
        "nonfinite_backward": Advice(
            "NaN/Inf produced in the backward pass",
            (),
            "gradient overflow: lower the learning rate or the loss scale, clip gradients; in attention also try qk_norm",
        ),
        "nonfinite_optimizer": Advice(
            "NaN/Inf in optimizer state or update",
            (),
            "roll back to the last good state; lower the learning rate; check Adam ε and the second moment (exp_avg_sq) of the named parameter",
        ),
        "nonfinite_input": Advice(
            "the batch holds NaN/Inf", (), "fix the data pipeline; skip the batch (action 'skip')"
        ),
        "nonfinite_loss": Advice(
            "the loss computation produced NaN/Inf",
            (),
            "the model output was finite: check the loss code (log of 0, division by a zero count, all-masked targets)",
        ),
        "nonfinite_unknown": Advice(
            "NaN/Inf not reproduced on replay",
            (),
            "a transient fault (hardware?) or a norm that overflowed float32: skip the step or roll back",
        ),
        "nonfinite_repeat": Advice(
            "NaN/Inf again on the next step",
            (),
            "the weights or optimizer state stay broken: roll back (action 'rollback') or stop and resume from a checkpoint",
        ),
        "nonfinite_unlocalized": Advice(
            "NaN/Inf seen at the log interval",
            (),
            "set DetectConfig(actions={'nonfinite': 'skip'}) or sync=True to decide per step, skip the update and name the module",
        ),
    }

    def __init__(self, ctx: DetectorContext) -> None:
        super().__init__(ctx)
        self.options = ctx.options(self.kind, NonfiniteOptions)

    def observe(self, step: int, values: Mapping[str, float]) -> Observation:
        """Nothing: non-finite steps are decided by its device part, which sees the tensors."""
        return Observation()

    def device_checks(self, ctx: DeviceContext) -> DeviceChecks:
        """The device part: `NonfiniteWatch` (the step guard's hooks, and the tracer's with ``per_module``)."""
        from .watch import NonfiniteWatch

        return NonfiniteWatch(ctx, self.options)

    def signature(self, event: Event) -> str:
        """By the pass and module that produced the value (a repeat, the output head, a norm, attention...)."""
        pass_ = event.details.get("pass")
        if event.details.get("repeat") and pass_ in (None, "optimizer"):
            return "nonfinite_repeat"
        if pass_ is None:
            return "nonfinite_output" if event.where.startswith("logits/") else "nonfinite_unlocalized"
        if pass_ in ("input", "loss", "optimizer", "unknown"):
            return f"nonfinite_{pass_}"
        module = event.details.get("module", "")
        if _inside(module, self.ctx.attention_paths):
            return "nonfinite_attention"
        if module in ("", self.ctx.output_head):
            return "nonfinite_output"
        if _inside(module, self.ctx.norm_paths) or re.search(r"(^|\.)(ln|norm)[\w]*$", module):
            return "nonfinite_norm"
        return f"nonfinite_{pass_}" if pass_ in ("forward", "backward") else "nonfinite_forward"


def _inside(path: str, roots: tuple[str, ...]) -> bool:
    return any(r and (path == r or path.startswith(r + ".")) for r in roots)
