"""z-loss (PaLM): ``coef · mean(log Z²)`` with ``log Z = logsumexp(logits, -1)``, keeping log Z near 0.

Two ways to use it:

- explicit: ``loss = ce + z_loss(logits)`` (re-exported as ``stabkit.z_loss``);
- implicit: ``apply(model, "z_loss")`` puts an identity autograd function on the final logits (a
  forward hook where discovery found them: the output head, or the model's own output when the
  model scales or caps after the head; no attention discovery needed). Its
  forward returns the logits unchanged; its backward adds the gradient of the explicit term, so
  the user's loss code stays as it is. The term's value is kept (detached, on the device) for the
  monitor as ``logits/z_loss``; it is not added to the user's loss value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..discovery.trace import tracing
from ..plugins import INTERVENTIONS
from ..tables import bounds
from .base import Intervention
from .common import keep_hook, logits_map, warn_internal_loss
from .handle import Handle, InterventionError

NAME = "z_loss"
METRIC = "logits/z_loss"


def z_loss(logits: torch.Tensor, coef: float = 1e-4) -> torch.Tensor:
    """``coef · mean over positions of logsumexp(logits, -1)²`` (computed in float32)."""
    return coef * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()


class _ZLossGrad(torch.autograd.Function):
    """Identity on the logits whose backward adds d/dlogits of ``coef · mean(lse²)``."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, lse: torch.Tensor, coef: float) -> torch.Tensor:
        ctx.save_for_backward(logits, lse)
        ctx.coef = coef
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        logits, lse = ctx.saved_tensors  # (..., V), (..., 1)
        rows = lse.numel()
        # d/dx coef·mean(lse²) = coef · 2·lse/rows · softmax(x)
        extra = torch.exp(logits.float() - lse) * (lse * (2.0 * ctx.coef / rows))
        return grad + extra.to(grad.dtype), None, None


def apply_z_loss(model: nn.Module, coef: float = 1e-4, model_map_override: Any = None) -> Handle:
    """Hook the implicit z-loss onto the model's final logits (see the module docstring).

    Runs its hook in every forward: one logsumexp over the logits (for the metric and the backward).
    """
    if not coef >= 0:
        raise InterventionError(NAME, "", f"coef must be >= 0, got {coef!r}")
    where = logits_map(model, NAME, model_map_override)
    module = model.get_submodule(where.path)
    handle = Handle(model, [NAME])
    last: dict[str, torch.Tensor] = {}
    said: set[int] = set()

    def hook(mod: nn.Module, args: Any, output: Any) -> Any:
        logits = where.take(output)
        if not isinstance(logits, torch.Tensor):
            raise InterventionError(
                NAME, where.path or "<model>", f"output of type {type(output).__name__} has no logits"
            )
        with torch.no_grad():
            lse = torch.logsumexp(logits.detach().float(), dim=-1, keepdim=True)  # (..., 1)
            if not tracing():  # discovery's or the apply-time check's forward is not a training step
                last[METRIC] = coef * lse.pow(2).mean()
        if not (torch.is_grad_enabled() and logits.requires_grad) or coef == 0:
            return None
        warn_internal_loss(NAME, where.path, output, said)
        return where.replace(output, _ZLossGrad.apply(logits, lse, coef))

    keep_hook(handle, module.register_forward_hook(hook))
    handle.set_metrics(lambda: dict(last))
    return handle


@dataclass(frozen=True)
class ZLossOptions:
    """The options of ``z_loss``."""

    coef: float = field(default=1e-4, metadata=bounds(lo=0.0))
    """Weight of mean(log Z²) (PaLM: 1e-4)."""


@INTERVENTIONS.register
class ZLossIntervention(Intervention):
    """``z_loss``: the implicit z-loss on the final logits. Exact at a mid-run switch: it changes only
    gradients, never a weight or an output."""

    name = NAME
    order = 60
    description = "adds the gradient of coef·mean(logsumexp(logits)²) without touching the loss code (PaLM)"
    options_class = ZLossOptions
    midrun = True
    midrun_preference = 30

    def apply(self, model: nn.Module, model_map: Any, options: ZLossOptions) -> Handle:
        return apply_z_loss(model, options.coef, model_map)
