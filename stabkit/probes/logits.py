"""Output-logit probe: max |logit|, log Z (mean, max) and the mean logit of the model's final logits.

A forward hook where discovery found the final logits (`ModelMap.logits`: the output head, or the
model's own output when it scales or caps after the head), on sampled steps, in training forwards
only (`ProbeContext.training_forward`). log Z = logsumexp over the vocabulary; its drift is the
output-logit divergence of Wortsman et al. 2023, who plot it as the mean output logit (over the
vocabulary and positions) drifting far negative: `logits/mean`.

Under ``torch.compile`` the hook is traced into the sampled graph and measures through the opaque
op ``torch.ops.stabkit.logit_stats`` (`stabkit.stats.opaque`: the eager code, one graph output).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..stats import logit_stats
from ..stats.opaque import LOGIT_COMBINES
from ..stats.recorder import Reduction
from .base import Probe, ProbeContext, first_tensor, guarded

NAMES = ("logits/max_abs", "logits/logz_mean", "logits/logz_max", "logits/mean")
REDUCTIONS: tuple[Reduction, ...] = ("max", "mean", "max", "mean")


class LogitProbe(Probe):
    """Writes `logits/max_abs`, `logits/logz_mean`, `logits/logz_max`, `logits/mean`."""

    name = "logits"
    families = frozenset({"logits"})

    def attach(self, ctx: ProbeContext) -> None:
        super().attach(ctx)
        where = ctx.model_map.logits
        if where is None:
            return
        self.where = where
        module = ctx.model.get_submodule(where.path)
        self.watch_forwards()
        self.handles.append(ctx.hooks.forward(self.name, module, self._hook))

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        ctx = self.ctx
        assert ctx is not None
        if not (self.enabled and ctx.sampled() and ctx.training_forward(module)):
            return
        logits = self.where.take(output)
        if logits is not None:
            self._measure(logits)

    @guarded
    def _measure(self, output: Any) -> None:
        """Forward hook body (after the module that yields the final logits, sampled training forwards)."""
        ctx = self.ctx
        assert ctx is not None
        if torch.compiler.is_compiling():  # one opaque op, one graph output
            phase, every = ctx.phase, ctx.config.every
            packed = torch.ops.stabkit.logit_stats(first_tensor(output).detach(), phase.gate, every)
            gated = every if phase.gated else None
            ctx.recorder.add_packed(NAMES, LOGIT_COMBINES, REDUCTIONS, packed, every=gated)
            return
        max_abs, logz_mean, logz_max, mean = logit_stats(first_tensor(output))
        rec = ctx.recorder
        rec.add("logits/max_abs", max_abs, combine="max", reduction="max")
        rec.add("logits/logz_mean", logz_mean, combine="mean", reduction="mean")
        rec.add("logits/logz_max", logz_max, combine="max", reduction="max")
        rec.add("logits/mean", mean, combine="mean", reduction="mean")
