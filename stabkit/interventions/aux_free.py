"""``aux_free_balance``: DeepSeek-V3's auxiliary-loss-free load balancing — a bias per expert added to
the routing scores for the choice only, moved after each optimizer step towards the even load.

At apply time every router (`stabkit.interventions.router_site`) gets a selection bias b (E,), zero:
its top-k over the experts picks on ``scores + b`` and the weights are the scores themselves, so
nothing has a gradient through b and, at the switch, the model computes exactly what it did (a
mid-run fix). A router that already has such a bias (DeepSeek-V3's ``e_score_correction_bias``,
`MoEMap.score_bias`) keeps its own: that buffer is the one updated (and restored bit for bit by
``remove``). The experts each training forward chose are counted on the device (summed over ranks
under ``torch.distributed`` before the update); after each optimizer step (`attach_optimizer`, or
``handle.update()`` by hand)::

    b_e += gamma · sign(mean load − load_e)

(DeepSeek-V3 §2.1.2, gamma 0.001), then the counts restart. ``moe/aux_free_bias_absmax`` (the largest
|b_e| over routers) goes to the monitor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..discovery.trace import Trace, tracing
from ..plugins import INTERVENTIONS
from ..tables import bounds
from .base import Intervention
from .handle import Handle
from .router_site import RouterHandle, RouterSite, check_sites, router_sites

NAME = "aux_free_balance"
METRIC = "moe/aux_free_bias_absmax"


class _Balancer:
    """One router's bias and the load counted since the last update."""

    def __init__(self, site: RouterSite, bias: torch.Tensor, own: bool) -> None:
        self.site = site
        self.bias = bias
        self.own = own
        """True: stabkit's bias; False: the router's own score bias (updated in place)."""
        self.load = torch.zeros(site.moe.n_experts, device=bias.device, dtype=torch.float32)

    def take(self, indices: torch.Tensor) -> None:
        """The experts one router call chose (forward time): counted in training forwards."""
        if tracing() or not torch.is_grad_enabled() or not self.site.module.training:
            return
        flat = indices.detach().reshape(-1)
        self.load.index_add_(0, flat, torch.ones(flat.numel(), device=flat.device))


class AuxFreeHandle(RouterHandle):
    """The handle of ``aux_free_balance``: ``update()`` after each optimizer step."""

    def __init__(self, model: nn.Module, sites: list[RouterSite], gamma: float) -> None:
        super().__init__(model, NAME, sites)
        self.gamma = gamma
        self.balancers: list[_Balancer] = []
        self._watch: list[Any] = []
        self.on_remove(self.unwatch)

    @torch.no_grad()
    def update(self) -> None:
        """Move every bias by gamma · sign(mean load − load) and restart the counts (after an
        optimizer step; device ops only). A router that routed nothing since the last update is left."""
        if self.removed:
            return
        loads = [b.load for b in self.balancers]
        if loads and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flat = torch.cat(loads)
            dist.all_reduce(flat)
            loads = list(flat.split([b.load.numel() for b in self.balancers]))
        for balancer, load in zip(self.balancers, loads, strict=True):
            step = self.gamma * torch.sign(load.mean() - load)
            balancer.bias.add_(step.to(balancer.bias.dtype))
            balancer.load.zero_()

    def watch(self, optimizer: Any, hooks: Any = None) -> None:
        """Update after every ``optimizer.step()`` (a step post-hook; a list or `OptimizerSet`: after
        the last one)."""
        self.unwatch()
        last = optimizer[-1] if isinstance(optimizer, list | tuple) else optimizer
        if hooks is not None:
            self._watch = [hooks.step_post(NAME, last, lambda opt, args, kwargs: self.update())]
        else:
            self._watch = [last.register_step_post_hook(lambda opt, args, kwargs: self.update())]

    def unwatch(self) -> None:
        while self._watch:
            self._watch.pop().remove()


def apply_aux_free(model: nn.Module, gamma: float = 1e-3, model_map_override: Any = None) -> AuxFreeHandle:
    """Put a selection bias on every router of `model` (see the module docstring; apply time)."""
    sites = router_sites(model, NAME, model_map_override)
    handle = AuxFreeHandle(model, sites, gamma)
    for site in sites:
        if site.moe.score_bias is not None:
            bias = model.get_buffer(site.moe.score_bias) if _is_buffer(model, site.moe.score_bias) else None
            if bias is None:
                bias = model.get_parameter(site.moe.score_bias)
            kept = bias.detach().clone()
            handle.on_remove(partial(_restore, bias, kept))
            balancer = _Balancer(site, bias.data, own=False)
        else:
            balancer = _Balancer(site, torch.zeros(site.moe.n_experts, device=site.weight.device), own=True)
            site.bias = (NAME, balancer.bias)
        site.chosen[NAME] = balancer.take
        handle.balancers.append(balancer)

    def metrics() -> dict[str, torch.Tensor]:
        return {METRIC: torch.stack([b.bias.detach().float().abs().max() for b in handle.balancers]).max()}

    handle.set_metrics(metrics)
    return handle


def _restore(bias: torch.Tensor, kept: torch.Tensor) -> None:
    """Put the router's own score bias back as it was at apply (remove time)."""
    with torch.no_grad():
        bias.copy_(kept)


def _is_buffer(model: nn.Module, path: str) -> bool:
    return path in dict(model.named_buffers())


@dataclass(frozen=True)
class AuxFreeOptions:
    """The options of ``aux_free_balance``."""

    gamma: float = field(default=1e-3, metadata=bounds(lo=0.0))
    """Bias update speed per optimizer step (DeepSeek-V3: 0.001)."""


@INTERVENTIONS.register
class AuxFreeBalanceIntervention(Intervention):
    """``aux_free_balance`` (see the module docstring). Exact at a mid-run switch: the bias starts at
    zero (or at the router's own), so the model computes what it did until the first update."""

    name = NAME
    order = 66
    description = "a bias on the routing scores for the choice only, moved by gamma·sign(mean load − load) after each optimizer step (DeepSeek-V3)"
    options_class = AuxFreeOptions
    midrun = True
    midrun_preference = 45

    def apply(self, model: nn.Module, model_map: Any, options: AuxFreeOptions) -> Handle:
        return apply_aux_free(model, options.gamma, model_map)

    def verify(self, trace: Trace, model: nn.Module, handle: Handle) -> None:
        if isinstance(handle, RouterHandle):
            check_sites(self.name, handle, handle.sites, "topk")

    def attach_optimizer(self, handle: Handle, optimizer: Any, record: Any = None, hooks: Any = None) -> None:
        if isinstance(handle, AuxFreeHandle):
            handle.watch(optimizer, hooks)
