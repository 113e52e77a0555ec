"""The 'depth_grad' kind: depth-gradient imbalance of a post-norm model that does not warm up.

Xiong et al. 2020 (Thm. 1): at initialisation the gradients of a post-LN Transformer are largest
near the output and do not shrink with depth, while under pre-LN they fall like 1/√L; post-LN
therefore needs a learning-rate warmup, and without one it is lost from the first steps (stabkit's
post-norm-no-warmup recipe: a plateau from step one; the audit at attach flags the architecture).
This detector *measures* it, on post-norm models only, at the first step (``early_steps``: at
initialisation, which the theory describes), from the gradient norms of the first and the last block
(``grad/<block>/norm``, before clipping; sampled at step 0):

    imbalance = (‖g_last‖ / ‖g_first‖) · √L        (L blocks)

Measured at init on the reference GPT (3 seeds): post-LN 1.4 at 2 layers, 2.0–2.3 at 6, 3.0–3.9 at
12. The score says nothing about a pre-norm or sandwich model: its ratio depends on the init (0.8–0.95
with residual projections scaled by 1/√(2L), ≈ 0.9·√L with PyTorch's or Hugging Face's init, which
crosses any constant threshold at a few layers) and its gradients need no warmup — so only blocks
that discovery places 'post' (the majority of the blocks) are judged.

Warmup is what post-LN needs, so it is judged from the optimizer's learning rate (``opt/lr``, read
every step, `stabkit.learning_rate`): the detector keeps the score of step 0 and watches the LR for
``warmup_check`` steps; an LR that rises in that time is a warmup — no event. An LR that does not rise
makes the event, at the end of the check (a few steps after init: the run is lost later, on a
plateau). ``attach(..., warmup_steps=N)`` decides at once (N > 0: warmup; 0: none). Without an LR
series (no optimizer) and no warmup given, the event comes at step 0, as a 'warning'. One event per
run. Options: `DepthGradOptions` (``DetectConfig.options["depth_grad"]``). Pure Python; checkpointable.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..events import Event
from ..learning_rate import LR_SERIES
from ..metric_names import GRAD, metric
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
    warmup_check: int = field(default=5, metadata=bounds(lo=1))
    """Steps after the first whose learning rate (``opt/lr``) is compared with the first step's: a
    rise of more than 1 % is a warmup."""


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
            "a run whose LR rises in its first steps is recognised as warming up",
        ),
    }

    def __init__(self, ctx: DetectorContext) -> None:
        super().__init__(ctx)
        self.options = ctx.options(self.kind, DepthGradOptions)
        paths = ctx.block_paths
        self.first = metric(GRAD, paths[0], "norm") if paths else None
        self.last = metric(GRAD, paths[-1], "norm") if paths else None
        self.depth = len(paths)
        post = sum(1 for b in ctx.blocks if b.placement == "post")
        self.active = (
            self.depth >= self.options.min_blocks
            and 2 * post > self.depth
            and not (ctx.warmup_steps is not None and ctx.warmup_steps > 0)
        )
        self.fired = False
        self.pending: dict[str, float] | None = None
        """The step-0 measurement waiting for the LR check: score, ratio, step, first LR."""

    def wants(self, name: str) -> bool:
        """The first and the last block's gradient norm and the learning rate (when the check is active)."""
        return self.active and name in (self.first, self.last, LR_SERIES)

    def observe(self, step: int, values: Mapping[str, float]) -> Observation:
        """Measure the imbalance on a step before `early_steps`; the event once the LR shows no warmup."""
        if self.fired or not self.active:
            return Observation()
        lr = values.get(LR_SERIES)
        if self.pending is not None:
            return self._check_warmup(step, lr)
        if step >= self.options.early_steps:
            return Observation()
        first, last = values.get(self.first or ""), values.get(self.last or "")
        if first is None or last is None or not (first > 0 and math.isfinite(first) and math.isfinite(last)):
            return Observation()
        score = last / first * math.sqrt(self.depth)
        if score < self.options.threshold:
            return Observation()
        self.pending = {"score": score, "ratio": last / first, "step": step, "lr": math.nan}
        if self.ctx.warmup_steps == 0 or lr is None:  # no warmup, or no rate to tell one by
            return self._event(step, "no warmup given" if self.ctx.warmup_steps == 0 else "warmup not known")
        self.pending["lr"] = lr
        return Observation()

    def _check_warmup(self, step: int, lr: float | None) -> Observation:
        pending = self.pending
        assert pending is not None
        if lr is not None and lr > pending["lr"] * 1.01:
            self.fired = True  # a warmup: the imbalance is what it is for
            self.pending = None
            return Observation()
        if step - pending["step"] < self.options.warmup_check:
            return Observation()
        return self._event(
            step,
            f"the learning rate did not rise over steps {int(pending['step'])}–{step} (lr {pending['lr']:.3g}): no warmup",
        )

    def _event(self, step: int, warmup: str) -> Observation:
        pending = self.pending
        assert pending is not None
        self.fired = True
        self.pending = None
        score, ratio = pending["score"], pending["ratio"]
        message = (
            f"post-norm model: the last block's gradient norm is {ratio:.2f}× the first block's at "
            f"initialisation (×√{self.depth} = {score:.2f} ≥ {self.options.threshold:g}) and {warmup} — "
            "Xiong et al. 2020: post-LN runs are lost without warmup"
        )
        details = {
            "ratio": ratio,
            "score": score,
            "blocks": self.depth,
            "since": int(pending["step"]),
            "lr": None if math.isnan(pending["lr"]) else pending["lr"],
        }
        return Observation(
            [Event(step, self.kind, self.last or "", score, self.options.threshold, message, details=details)]
        )

    def signature(self, event: Event) -> str:
        """post_norm_no_warmup."""
        return "post_norm_no_warmup"

    def state_dict(self) -> dict[str, Any]:
        """Whether it fired, and a measurement waiting for the LR check."""
        return {"fired": self.fired, "pending": self.pending}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""
        self.fired = bool(state.get("fired", False))
        pending = state.get("pending")
        self.pending = {k: float(v) for k, v in pending.items()} if pending else None
