"""Where the router interventions act: inside each mixture-of-experts router's forward, at its gate
projection and at its top-k choice, on the routers discovery found (`stabkit.moe.find`).

A router computes its logits and its choice inside one forward, and returns them in no fixed form
(Mixtral returns the logits beside the choice, Llama 4 only the scores, the reference GPT its
weights); what reaches the loss is the routing weights, made inside. So the edits are made where the
router makes them: at apply time the router module's ``forward`` is wrapped (an instance attribute,
deleted again by ``remove``) so that it runs under a `RouterMode`, a ``TorchFunctionMode`` that, in
that forward only,

- at ``F.linear`` on the gate weight (`MoEMap.gate_weight`, or a ``.type``/``.to``/``.float`` copy of
  it): computes the projection in float32 with autocast off (``router_fp32``), then passes the logits
  through each logit edit (``router_z_loss``, ``load_balance_loss``: an identity whose backward adds
  the gradient of their term);
- at a ``topk`` over the E experts (the last dimension): selects on the scores plus a bias
  (``aux_free_balance``) and weighs by the scores themselves, and hands the chosen experts to whoever
  counts them (the load-balancing loss, the bias update).

One `RouterSite` per router module holds every active edit, so several router interventions stack in
any order and come off in any order. Counts of the calls changed (`Handle.counts`, per router path)
let each intervention's `verify` check, on the apply-time traced forward, that it is in effect.
A router whose gate projection is not a named parameter (a registered router,
`stabkit.moe.register_router`) is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..discovery import ModelMap
from ..moe.map import MoEMap
from .common import model_map
from .handle import Handle, InterventionError

SITE_ATTR = "_stabkit_router_site"
ALIAS_OPS = {torch.Tensor.type, torch.Tensor.to, torch.Tensor.float}
"""Ops whose output on the gate weight is still the gate weight (DeepSeek-V3: ``weight.type(float32)``)."""
TOPK_OPS = {torch.topk, torch.Tensor.topk}

LogitEdit = Callable[[torch.Tensor, "RouterCall"], torch.Tensor]
"""(gate logits, the router call) -> the logits passed on (forward unchanged)."""


@dataclass
class RouterCall:
    """One forward of one router: what its edits share (the chosen experts, once picked)."""

    indices: torch.Tensor | None = None
    """(N, k) the experts the top-k over E chose (after any selection bias)."""


@dataclass
class RouterSite:
    """The active edits of one router module (see the module docstring)."""

    module: nn.Module
    moe: MoEMap
    weight: torch.Tensor
    fp32: str | None = None
    """The intervention that asked for the gate projection in float32 (``router_fp32``), or None."""
    logit_edits: dict[str, LogitEdit] = field(default_factory=dict)
    bias: tuple[str, torch.Tensor] | None = None
    """(intervention, (E,) bias added to the scores for the choice only)."""
    chosen: dict[str, Callable[[torch.Tensor], None]] = field(default_factory=dict)
    """Per intervention, called with the (N, k) chosen experts of every router call."""
    handles: dict[str, Handle] = field(default_factory=dict)
    """Per intervention, its handle (the calls it changed are counted on it)."""
    original: Any = None
    """The module's own ``forward`` instance attribute before the wrap (None: it had none)."""

    def empty(self) -> bool:
        return self.fp32 is None and not self.logit_edits and self.bias is None and not self.chosen

    def count(self, name: str, what: str) -> None:
        handle = self.handles.get(name)
        if handle is not None:
            handle.count(f"{self.moe.router}:{what}")


class RouterMode(TorchFunctionMode):
    """Active during one router forward: applies its site's edits (see the module docstring)."""

    def __init__(self, site: RouterSite) -> None:
        super().__init__()
        self.site = site
        self.call = RouterCall()
        self.aliases: list[torch.Tensor] = [site.weight]  # kept alive: their ids stay unique

    def _is_weight(self, x: Any) -> bool:
        return isinstance(x, torch.Tensor) and any(x is a for a in self.aliases)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in ALIAS_OPS and args and self._is_weight(args[0]):
            out = func(*args, **kwargs)
            self.aliases.append(out)
            return out
        if func is F.linear and len(args) >= 2 and self._is_weight(args[1]):
            return self._gate(func, args, kwargs)
        if func in TOPK_OPS and args:
            return self._topk(func, args, kwargs)
        return func(*args, **kwargs)

    def _gate(self, func: Any, args: Any, kwargs: dict[str, Any]) -> torch.Tensor:
        site = self.site
        if site.fp32 is not None:
            x, w = args[0], args[1]
            b = args[2] if len(args) > 2 else kwargs.get("bias")
            with torch.autocast(x.device.type, enabled=False):
                logits = F.linear(x.float(), w.float(), b.float() if b is not None else None)
            site.count(site.fp32, "gate")
        else:
            logits = func(*args, **kwargs)
        for name, edit in site.logit_edits.items():
            site.count(name, "gate")
            logits = edit(logits, self.call)
        return logits

    def _topk(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        site = self.site
        scores = args[0]
        k = args[1] if len(args) > 1 else kwargs.get("k")
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        largest = args[3] if len(args) > 3 else kwargs.get("largest", True)
        n = site.moe.n_experts
        last = (
            isinstance(scores, torch.Tensor) and scores.dim() > 0 and dim % scores.dim() == scores.dim() - 1
        )
        if not (last and scores.shape[-1] == n and largest and isinstance(k, int)):
            return func(*args, **kwargs)
        if site.bias is not None:
            name, bias = site.bias
            picked = (scores.detach() + bias.to(scores.dtype)).topk(k, dim=-1).indices
            out = torch.return_types.topk((scores.gather(-1, picked), picked))
            site.count(name, "topk")
        else:
            out = func(*args, **kwargs)
        self.call.indices = out.indices
        for name, take in site.chosen.items():
            site.count(name, "topk")
            take(out.indices)
        return out


def _wrapped(module: nn.Module, site: RouterSite) -> Callable[..., Any]:
    own = type(module).forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        inner = site.original if site.original is not None else own.__get__(module)
        with RouterMode(site):
            return inner(*args, **kwargs)

    return forward


def router_sites(
    model: nn.Module, name: str, override: dict[str, Any] | ModelMap | None = None
) -> list[RouterSite]:
    """The `RouterSite` of every MoE router of `model` (created and installed on first use; apply
    time). Raises InterventionError naming `name` when the model has no router discovery found, or
    when a router's gate projection is not a parameter stabkit can see."""
    if any(p.is_meta for p in model.parameters()):
        # not an InterventionError: nothing says the model cannot take it (a recipe's preflight
        # builds on the meta device and leaves the check to the worker's real model)
        raise NotImplementedError(
            f"{name}: routers are found in a traced forward, which a meta-device model cannot run"
        )
    mmap = model_map(model, name, override)
    if not mmap.moe:
        raise InterventionError(
            name,
            type(model).__name__,
            "no mixture-of-experts router found (a top-k over the outputs of a gate projection); a router "
            "discovery cannot see can be registered with stabkit.register_router, but this intervention "
            "also needs its gate projection",
        )
    sites = []
    for moe in mmap.moe:
        if moe.gate_weight is None:
            raise InterventionError(
                name,
                moe.router,
                f"the router's gate projection is not known ({moe.found} router): this intervention acts "
                "at the F.linear on the gate weight inside the router's forward",
            )
        module = model.get_submodule(moe.router)
        site = module.__dict__.get(SITE_ATTR)
        if site is None:
            site = RouterSite(module, moe, model.get_parameter(moe.gate_weight))
            site.original = module.__dict__.get("forward")
            module.__dict__[SITE_ATTR] = site
            module.forward = _wrapped(module, site)
        sites.append(site)
    return sites


def release(site: RouterSite, name: str) -> None:
    """Take intervention `name`'s edits off `site`, and unwrap the router when none is left (remove time)."""
    if site.fp32 == name:
        site.fp32 = None
    if site.bias is not None and site.bias[0] == name:
        site.bias = None
    site.logit_edits.pop(name, None)
    site.chosen.pop(name, None)
    site.handles.pop(name, None)
    if site.empty() and site.module.__dict__.get(SITE_ATTR) is site:
        del site.module.__dict__[SITE_ATTR]
        if site.original is not None:
            site.module.forward = site.original
        else:
            del site.module.forward


def claim(sites: list[RouterSite], name: str, handle: Handle) -> None:
    """Register `handle` as `name`'s on every site, undone by ``handle.remove()`` (apply time)."""
    for site in sites:
        site.handles[name] = handle
        handle.on_remove(partial(release, site, name))


def check_sites(name: str, handle: Handle, sites: list[RouterSite], what: str) -> None:
    """Every router of `sites` had its `what` ("gate" or "topk") changed for `name` in the traced
    forward (`Intervention.verify`); else InterventionError naming the router."""
    for site in sites:
        if handle.counts.get(f"{site.moe.router}:{what}", 0) == 0:
            seen = (
                "gate projection (F.linear on its gate weight)"
                if what == "gate"
                else "top-k over its experts"
            )
            raise InterventionError(
                name,
                site.moe.router,
                f"not in effect: the router ran without a {seen} that stabkit could change",
            )


class RouterHandle(Handle):
    """The handle of a router intervention: its sites, for `verify`."""

    def __init__(self, model: nn.Module, name: str, sites: list[RouterSite]) -> None:
        super().__init__(model, [name])
        self.sites = sites
        claim(sites, name, self)
