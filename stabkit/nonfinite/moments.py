"""A negative Adam second moment, named before the update it would make NaN.

Adam(W) (and NAdam, RAdam, amsgrad) divide each update by ``√v̂ + ε`` with the second moment
``v = β2·v + (1 − β2)·g²`` (``exp_avg_sq``; amsgrad's denominator reads ``max(max_exp_avg_sq, v)``).
No gradient makes ``v`` negative, but code can: a bad checkpoint or state surgery, an 8-bit or
sharded state written back wrongly. ``v`` is finite then, so the NaN/Inf checks see nothing until
the update has written NaN into the parameter.

When it runs: in the optimizer step pre-hook (`stabkit.nonfinite.watch.NonfiniteWatch.before_update`),
on the steps the parameter / optimizer-state check runs (`NonfiniteOptions.optimizer_check_every`),
when non-finite steps are decided every step (an action other than warn, or ``DetectConfig.sync``).
`negative_flag` is the device part: one min per second-moment tensor, no host sync (the watch's
flag joins the step's one copy). On a hit only, `find_negative` reads the state on the host, names
the first parameter (model order) and computes this step's ``v`` exactly from its gradient, so the
event says whether the coming update is NaN (critical, before it lands: 'skip' keeps the parameters
finite) or this step's squared gradients outweigh the negative entries (a note, 'info': the state
was written wrongly, but the update stays finite and ``v`` is non-negative after it; no action
acts on a note, so 'skip' does not keep a state that heals itself).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..distributed.context import local
from ..events import Event

MOMENT_KEYS = ("exp_avg_sq", "max_exp_avg_sq")
"""The state entries read: Adam's second moment, and amsgrad's running max of it."""


def second_moments(optimizer: Any) -> Iterator[tuple[torch.Tensor, dict[str, Any], str, torch.Tensor]]:
    """(parameter, its group, state key, tensor) for each floating second-moment tensor of an
    Adam-like group (one with ``betas``), in the optimizer's order."""
    state = getattr(optimizer, "state", {})
    for group in getattr(optimizer, "param_groups", []):
        if "betas" not in group:
            continue
        for p in group["params"]:
            entries = state.get(p, {})
            for key in MOMENT_KEYS:
                t = entries.get(key)
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() > 0:
                    yield p, group, key, t


def negative_flag(optimizer: Any) -> torch.Tensor | None:
    """0-d bool device tensor: some second-moment entry is below zero (None: no such state yet,
    e.g. before the first step). One ``amin`` per tensor; no host sync."""
    minima: dict[torch.device, list[torch.Tensor]] = {}
    with torch.no_grad():
        for _, _, _, t in second_moments(optimizer):
            t = local(t)  # FSDP2 DTensor: this rank's shard
            if t.numel():
                minima.setdefault(t.device, []).append(t.amin().float())
        flags = [(torch.stack(values) < 0).any() for values in minima.values()]
    if not flags:
        return None
    first = flags[0].device
    return torch.stack([f.to(first) for f in flags]).any()


@dataclass
class NegativeMoment:
    """The first parameter (model order) whose second moment has negative entries."""

    param: str
    key: str
    """'exp_avg_sq' or 'max_exp_avg_sq'."""
    negative: int
    """Entries below zero now."""
    smallest: float
    nan_entries: int
    """Entries of the coming update that are NaN (this step's v, or amsgrad's max, still below zero)."""
    others: list[str]
    """Every parameter with a negative second moment (model order, at most 20)."""

    @property
    def module(self) -> str:
        return self.param.rsplit(".", 1)[0] if "." in self.param else ""


def find_negative(model: nn.Module, optimizer: Any) -> NegativeMoment | None:
    """On a hit of `negative_flag`, before the update (host reads): the first parameter in model
    order with a negative second moment, and how many entries of its coming update are NaN."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = {id(p): i for i, (_, p) in enumerate(model.named_parameters())}
    found: list[tuple[int, str, torch.Tensor, dict[str, Any], str, torch.Tensor]] = []
    with torch.no_grad():
        for p, group, key, t in second_moments(optimizer):
            v = local(t)
            if bool((v < 0).any()):  # sync point (on a hit only)
                found.append((order.get(id(p), len(order)), names.get(id(p), "?"), p, group, key, v))
    if not found:
        return None
    found.sort(key=lambda f: f[0])  # stable: a parameter's exp_avg_sq before its max_exp_avg_sq
    _, name, p, group, key, v = found[0]
    return NegativeMoment(
        name,
        key,
        int((v < 0).sum()),
        float(v.min()),
        _nan_entries(p, group, optimizer.state[p]),
        list(dict.fromkeys(f[1] for f in found))[:20],
    )


def _nan_entries(p: torch.Tensor, group: dict[str, Any], entries: dict[str, Any]) -> int:
    """Entries whose coming Adam denominator is √(negative): v' = β2·v + (1 − β2)·g², with the L2
    term of coupled weight decay in g, and amsgrad's max(max_exp_avg_sq, v')."""
    v = entries.get("exp_avg_sq")
    if not isinstance(v, torch.Tensor):
        return 0
    v = local(v).float()
    grad = torch.zeros_like(v) if p.grad is None else local(p.grad).detach().float()
    decay = float(group.get("weight_decay", 0.0) or 0.0)
    if decay and not group.get("decoupled_weight_decay", False):
        grad = grad + decay * local(p.detach()).float()
    beta2 = float(group["betas"][1])
    coming = beta2 * v + (1 - beta2) * grad * grad
    top = entries.get("max_exp_avg_sq") if group.get("amsgrad") else None
    if isinstance(top, torch.Tensor):
        coming = torch.maximum(local(top).float(), coming)
    return int((coming < 0).sum())


def negative_event(step: int, found: NegativeMoment) -> Event:
    """The 'nonfinite' event for `found`: critical when the coming update is NaN, else a note."""
    what = f"{found.key} of {found.param} has negative entries ({found.negative} of them, min {found.smallest:.3g})"
    if found.nan_entries:
        message = (
            f"{what}: the next Adam update is NaN (in {found.nan_entries} of its entries: √ of a negative "
            "second moment); the optimizer state was written wrongly (checkpoint, state surgery, a "
            "quantized or sharded state)"
        )
    else:
        message = (
            f"{what}: this step's squared gradients outweigh them, so the update stays finite, but the "
            "optimizer state was written wrongly (checkpoint, state surgery, a quantized or sharded state)"
        )
    return Event(
        step,
        "nonfinite",
        found.module or "(model)",
        found.smallest,
        0.0,
        message,
        details={
            "pass": "optimizer",
            "module": found.module,
            "tensor": f"{found.key} of {found.param}",
            "metric": found.key,
            "params": found.others,
            "negative_entries": found.negative,
            "nan_entries": found.nan_entries,
        },
        severity="critical" if found.nan_entries else "info",
    )
