"""``router_z_loss`` (ST-MoE) and ``load_balance_loss`` (Switch / GShard): a loss on each router's
logits, added to the user's loss without editing it, as ``z_loss`` is for the output logits.

At apply time each router's gate projection gets a logit edit (`stabkit.interventions.router_site`):
an identity on the (N, E) gate logits whose backward adds the gradient of the term, computed from the
logits saved in the forward (and, for the balancing loss, the experts the router then chose in that
forward). Summed over routers and forwards, as the papers add one term per MoE layer:

- ``router_z_loss``: ``coef · mean over tokens of logsumexp(logits)²`` (ST-MoE eq. 5, coef 1e-3);
- ``load_balance_loss``: ``coef · E · Σ_e f_e · P_e`` with f_e the share of the forward's k·N token
  choices that went to expert e (no gradient) and P_e the mean over tokens of the router's
  probability of e (Switch eq. 4, coef 1e-2; 1 when balanced): softmax(logits) for a softmax router
  and for a router choosing on raw logits (GPT-OSS, GraniteMoE, Llama 4), sigmoid scores normalised
  to sum 1 for a sigmoid router (DeepSeek-V3's sequence-wise balance loss, applied to the batch).

The terms' values (detached, on the device) are kept for the monitor (``moe/router_z_loss``,
``moe/load_balance_loss``: the last training forward's sum over routers); they are not added to the
user's loss value. Discovery's and the apply-time check's traced forwards are left unchanged (the
calls are counted there, for `verify`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..discovery.trace import Trace, tracing
from ..moe.map import MoEMap
from ..plugins import INTERVENTIONS
from ..tables import bounds
from .base import Intervention
from .handle import Handle
from .router_site import RouterCall, RouterHandle, check_sites, router_sites

Term = Callable[[torch.Tensor, RouterCall], torch.Tensor]
"""(float32 logits (N, E) with grad, the router call) -> the scalar term."""


def router_z(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss of one router call, without its coefficient: mean(logsumexp(logits)²)."""
    return torch.logsumexp(logits.float().reshape(-1, logits.shape[-1]), dim=-1).pow(2).mean()


def router_probs(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """(N, E) float32: the router's probability of each expert, for the balancing loss."""
    x = logits.float().reshape(-1, logits.shape[-1])
    if scoring == "sigmoid":
        s = x.sigmoid()
        return s / s.sum(-1, keepdim=True)
    return x.softmax(-1)


def balance(logits: torch.Tensor, indices: torch.Tensor, scoring: str) -> torch.Tensor:
    """Switch's load-balancing loss of one router call, without its coefficient:
    E · Σ_e f_e · P_e (f: share of the k·N choices per expert, P: mean router probability)."""
    n_experts = logits.shape[-1]
    chosen = indices.reshape(-1)
    f = torch.zeros(n_experts, device=logits.device, dtype=torch.float32)
    f.index_add_(0, chosen, torch.ones(chosen.numel(), device=logits.device))
    f = f / max(1, chosen.numel())
    return n_experts * (f * router_probs(logits, scoring).mean(0)).sum()


class _AddGrad(torch.autograd.Function):
    """Identity on the logits whose backward adds d(term)/d(logits)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, term: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(logits)
        ctx.term = term
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (logits,) = ctx.saved_tensors
        with torch.enable_grad():
            x = logits.detach().float().requires_grad_()
            (extra,) = torch.autograd.grad(ctx.term(x), x)
        return grad + extra.to(grad.dtype), None


class _Edit:
    """A router loss's logit edit on one router: adds the term's gradient in training forwards and
    keeps that forward's logits and choice, for the metric."""

    def __init__(self, coef: float, term: Term) -> None:
        self.coef, self.term = coef, term
        self.last: tuple[torch.Tensor, RouterCall] | None = None

    def total(self, call: RouterCall) -> Callable[[torch.Tensor], torch.Tensor]:
        coef, term = self.coef, self.term
        return lambda x: coef * term(x, call)

    def __call__(self, logits: torch.Tensor, call: RouterCall) -> torch.Tensor:
        if tracing() or not (torch.is_grad_enabled() and logits.requires_grad) or self.coef == 0:
            return logits
        self.last = (logits.detach(), call)
        out: torch.Tensor = _AddGrad.apply(logits, self.total(call))
        return out

    def value(self) -> torch.Tensor | None:
        """The term of the latest training forward (device, no sync; None before one)."""
        if self.last is None:
            return None
        logits, call = self.last
        with torch.no_grad():
            return self.total(call)(logits.float())


def apply_router_loss(
    model: nn.Module, model_map: Any, name: str, coef: float, term_of: Callable[[MoEMap], Term], metric: str
) -> Handle:
    """Put `name`'s logit edit on every router of `model` (apply time); `term_of(moe)` is the term of
    one call of that router."""
    sites = router_sites(model, name, model_map)
    handle = RouterHandle(model, name, sites)
    edits = []
    for site in sites:
        edit = _Edit(coef, term_of(site.moe))
        site.logit_edits[name] = edit
        edits.append(edit)

    def metrics() -> dict[str, torch.Tensor]:
        values = [v for v in (e.value() for e in edits) if v is not None]
        return {metric: torch.stack(values).sum()} if values else {}

    handle.set_metrics(metrics)
    return handle


def _z_term(moe: MoEMap) -> Term:
    return lambda x, call: router_z(x)


def _balance_term(moe: MoEMap) -> Term:
    scoring = moe.scoring

    def term(x: torch.Tensor, call: RouterCall) -> torch.Tensor:
        if call.indices is None:  # the router made no top-k over its experts stabkit saw
            return x.sum() * 0.0
        return balance(x, call.indices, scoring)

    return term


@dataclass(frozen=True)
class RouterZLossOptions:
    """The options of ``router_z_loss``."""

    coef: float = field(default=1e-3, metadata=bounds(lo=0.0))
    """Weight of mean(logsumexp(router logits)²), per MoE layer (ST-MoE: 1e-3)."""


@dataclass(frozen=True)
class LoadBalanceOptions:
    """The options of ``load_balance_loss``."""

    coef: float = field(default=1e-2, metadata=bounds(lo=0.0))
    """Weight of E·Σ f_e·P_e, per MoE layer (Switch Transformer: 1e-2)."""


def _ignore(indices: torch.Tensor) -> None:
    """The balancing loss reads the choice from its `RouterCall`; this only gets the top-k counted."""


def _verify(name: str, handle: Handle, what: str) -> None:
    if isinstance(handle, RouterHandle):
        check_sites(name, handle, handle.sites, what)


@INTERVENTIONS.register
class RouterZLossIntervention(Intervention):
    """``router_z_loss``: ST-MoE's router z-loss on every router. Exact at a mid-run switch: it changes
    only gradients, never a weight or an output."""

    name = "router_z_loss"
    order = 62
    description = "adds the gradient of coef·mean(logsumexp(router logits)²) per MoE layer, loss code untouched (ST-MoE)"
    options_class = RouterZLossOptions
    midrun = True
    midrun_preference = 50

    def apply(self, model: nn.Module, model_map: Any, options: RouterZLossOptions) -> Handle:
        return apply_router_loss(model, model_map, self.name, options.coef, _z_term, "moe/router_z_loss")

    def verify(self, trace: Trace, model: nn.Module, handle: Handle) -> None:
        _verify(self.name, handle, "gate")


@INTERVENTIONS.register
class LoadBalanceIntervention(Intervention):
    """``load_balance_loss``: the Switch / GShard auxiliary loss on every router. Changes only
    gradients (it can go on mid-run, but moves the router slowly: ``aux_free_balance`` is the
    rescue's fix)."""

    name = "load_balance_loss"
    order = 64
    description = "adds the gradient of coef·E·Σ f_e·P_e per MoE layer, loss code untouched (Switch, GShard)"
    options_class = LoadBalanceOptions

    def apply(self, model: nn.Module, model_map: Any, options: LoadBalanceOptions) -> Handle:
        handle = apply_router_loss(
            model, model_map, self.name, options.coef, _balance_term, "moe/load_balance_loss"
        )
        if isinstance(handle, RouterHandle):
            for site in handle.sites:  # counted, so `verify` sees the choice f is taken from
                site.chosen[self.name] = _ignore
        return handle

    def verify(self, trace: Trace, model: nn.Module, handle: Handle) -> None:
        _verify(self.name, handle, "gate")
        _verify(self.name, handle, "topk")
