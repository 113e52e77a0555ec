"""The 'depth_grad' kind: depth-gradient imbalance in the first steps — post-norm without warmup.

Xiong et al. 2020 (Thm. 1): at initialisation the gradients of a post-LN Transformer are largest
near the output and do not shrink with depth, while under pre-LN they fall like 1/√L; post-LN
therefore needs a learning-rate warmup, and without one it is lost from the first steps (stabkit's
post-norm-no-warmup recipe: a plateau from step one; the audit at attach flags the architecture).
This detector *measures* it: on the first step (``early_steps``: at initialisation, which the theory
describes) it reads the gradient norms of the first and the last block (``grad/<block>/norm``, before
clipping; sampled at step 0) and scores

    imbalance = (‖g_last‖ / ‖g_first‖) · √L        (L blocks)

Measured at init on the reference GPT (3 seeds): pre-LN 1.0–1.1 at 2 layers, 0.8–0.95 at 6 and 12;
sandwich 0.7–1.0; post-LN 1.4 at 2 layers, 2.0–2.3 at 6, 3.0–3.9 at 12. An event when the score
reaches `threshold` (1.3) on a model of at least `min_blocks` (3) blocks, *unless* the run is known to
warm up (`DetectorContext.warmup_steps` > 0: `attach(..., warmup_steps=...)`, which the harness
passes) — then the imbalance is what warmup is for. One event per run. Options: `DepthGradOptions`
(``DetectConfig.options["depth_grad"]``). Pure Python; checkpointable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..events import Event
from ..plugins import DETECTORS
from ..tables import bounds
from .advice import Advice
from .base import Detector, DetectorContext, Observation


@dataclass(frozen=True)
class DepthGradOptions:
    """``DetectConfig.options["depth_grad"]``."""

    threshold: float = field(default=1.3, metadata=bounds(lo=0, lo_open=True))
    """Imbalance (last/first block gradient-norm ratio × √L) at or above which the check fires."""
    early_steps: int = field(default=1, metadata=bounds(lo=1))
    """Only steps before this one are judged (1: the first step, at initialisation). Later steps
    mislead: on the post-norm-no-warmup recipe the pre- and sandwich-norm variants scored 3.06 and
    1.44 at step 10 (0.86 and 0.83 at step 0), after ten full-LR updates."""
    min_blocks: int = field(default=3, metadata=bounds(lo=2))
    """Models with fewer blocks are not judged (at 2 layers post-LN trains without warmup)."""


@DETECTORS.register
class DepthGradDetector(Detector):
    """Gradient-norm imbalance between the last and the first block in the first steps."""

    kind = "depth_grad"
    options_class = DepthGradOptions
    advice: ClassVar[dict[str, Advice]] = {
        "post_norm_no_warmup": Advice(
            "gradients near the output dwarf those near the input at init, with no warmup",
            ("norm_placement",),
            "Xiong et al. 2020: post-LN needs a learning-rate warmup (BLEU 8.45 without, ~34 with 4,000 "
            "steps) — add a warmup, or move the norms to pre / sandwich placement (Chameleon, Gemma 2); "
            "if the run does warm up, pass attach(..., warmup_steps=N)",
        ),
    }

    def __init__(self, ctx: DetectorContext) -> None:
        super().__init__(ctx)
        self.options = ctx.options(self.kind, DepthGradOptions)
        paths = ctx.block_paths
        self.first = f"grad/{paths[0]}/norm" if paths else None
        self.last = f"grad/{paths[-1]}/norm" if paths else None
        self.depth = len(paths)
        self.active = self.depth >= self.options.min_blocks and not (
            ctx.warmup_steps is not None and ctx.warmup_steps > 0
        )
        self.fired = False

    def wants(self, name: str) -> bool:
        """The first and the last block's gradient norm (when the check is active)."""
        return self.active and name in (self.first, self.last)

    def observe(self, step: int, values: Mapping[str, float]) -> Observation:
        """An event when the imbalance reaches the threshold on a step before `early_steps`."""
        if self.fired or not self.active or step >= self.options.early_steps:
            return Observation()
        first, last = values.get(self.first or ""), values.get(self.last or "")
        if first is None or last is None or not (first > 0 and math.isfinite(first) and math.isfinite(last)):
            return Observation()
        score = last / first * math.sqrt(self.depth)
        if score < self.options.threshold:
            return Observation()
        self.fired = True
        warm = "not given" if self.ctx.warmup_steps is None else f"{self.ctx.warmup_steps} steps"
        message = (
            f"the last block's gradient norm is {last / first:.2f}× the first block's at step {step} "
            f"(×√{self.depth} = {score:.2f} ≥ {self.options.threshold:g}; pre-norm ≈ 1): post-norm "
            f"imbalance with warmup {warm} — Xiong et al. 2020: such runs are lost without warmup"
        )
        details = {"ratio": last / first, "score": score, "blocks": self.depth, "since": 0}
        return Observation(
            [Event(step, self.kind, self.last or "", score, self.options.threshold, message, details=details)]
        )

    def signature(self, event: Event) -> str:
        """post_norm_no_warmup."""
        return "post_norm_no_warmup"

    def state_dict(self) -> dict[str, Any]:
        """Whether it fired."""
        return {"fired": self.fired}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""
        self.fired = bool(state.get("fired", False))
