"""‖θ_new − θ_old‖ per parameter without keeping a copy of the parameters.

Runs in the optimizer's step post-hook on sampled steps. For torch's Adam, AdamW and SGD the
update is rebuilt from the optimizer state and the gradient that are still there right after
the step, so the only extra memory is two temporaries per parameter of a batch of at most
`BATCH_ELEMENTS` entries (or one parameter, when a parameter is larger). Adam(W) parameters whose
step count is a host number (torch's default, not ``capturable``/``fused``) are rebuilt a batch at a
time with ``torch._foreach_*`` ops — three writing passes per batch (√v, + ε, then one ``addcdiv`` that
also folds in decoupled decay) and the norms, instead of ~25 small ops per parameter,
which on a small model were most of the monitor's optimizer-step cost. Other optimizers fall back
to a snapshot taken in the pre-hook (one copy of the parameters on sampled steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..distributed import like_param, local
from ..stats import foreach_norm_f32
from ..stats.finite import any_nonfinite
from ..stats.step_facts import FiniteSeen

SUPPORTED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)

FUSED_DECAY_LIMIT = 1e30
"""Largest lr/bc1·√bc2 / (lr·wd) for which decoupled decay is rebuilt in one pass as
a·(θ + (scale/a)·m/d): beyond, (scale/a)·m/d could overflow float32 (decay ~1e-30 of the step)."""

BATCH_ELEMENTS = 1 << 20
"""Entries rebuilt at once by the foreach path (4 MiB of float32 temporaries), at least one parameter."""


def closed_form_supported(optimizer: Any) -> bool:
    """True when `update_norms` can rebuild the update of every parameter of `optimizer` (one
    optimizer, or an `OptimizerSet` of supported ones)."""
    each = getattr(optimizer, "optimizers", [optimizer])
    if any(type(opt) not in SUPPORTED for opt in each):
        return False
    return all(not g.get("differentiable", False) for g in optimizer.param_groups)


@torch.no_grad()
def update_norms(
    optimizer: Any, params: Sequence[torch.Tensor], seen: FiniteSeen | None = None
) -> list[torch.Tensor]:
    """Per-parameter ‖Δθ‖ (float32 0-d device tensors) of the step that just ran; 0 for skipped params.
    `seen`: filled with the parameters and state tensors the foreach path read, and whether one of
    them holds NaN/±Inf (`stabkit.stats.step_facts`)."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out: list[torch.Tensor | None] = [None] * len(params)
    batches: dict[tuple[Any, ...], list[tuple[int, torch.Tensor, dict]]] = {}
    for i, p in enumerate(params):
        owner = optimizer.owner(p) if hasattr(optimizer, "owner") else optimizer
        group = group_of.get(id(p))
        state = optimizer.state.get(p, {})
        if group is None or p.grad is None or (not state and not isinstance(owner, torch.optim.SGD)):
            out[i] = torch.zeros((), device=local(p).device)
            continue
        # FSDP2: this rank's shard of the parameter, its gradient and its state (DTensor.to_local())
        grad = local(like_param(p.grad, p))  # tensor parallel: the gradient in the parameter's layout
        own_state = state  # the optimizer's own tensors (DTensors under FSDP2), which `seen` names
        state = {k: local(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        param, p = p, local(p)
        if isinstance(owner, torch.optim.SGD):
            delta = _sgd_delta(p, grad, group, state)
        else:
            decoupled = isinstance(owner, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))
            step = _host_step(state["step"])
            if step is not None:  # rebuilt with its batch below
                key = (id(group), decoupled, step, p.device)
                batches.setdefault(key, []).append((i, p, state))
                if seen is not None:  # what its batch will read (a raise there leaves no note)
                    seen.tensors.update(id(own_state[k]) for k in read_state(group))
                    if _shrink(group, decoupled):  # θ_new too
                        seen.tensors.add(id(param))
                continue
            delta = _adam_delta(p, group, state, decoupled=decoupled)
        out[i] = torch.linalg.vector_norm(delta, dtype=torch.float32)
    workspaces: dict[torch.device, Workspace] = {}
    for (_, decoupled, step, device), items in batches.items():
        group = group_of[id(params[items[0][0]])]
        for part in _batches(items):
            space = workspaces.setdefault(device, Workspace(device))
            norms = _adam_batch_norms(
                [p for _, p, _ in part], [s for _, _, s in part], group, step, decoupled, seen, space
            )
            for (i, _, _), n in zip(part, norms, strict=True):
                out[i] = n
    return [n for n in out if n is not None]


def _host_step(step: Any) -> float | None:
    """Adam's step count as a host number, or None when it lives on an accelerator (capturable, fused):
    reading a CPU tensor is a host read, never a device sync."""
    if isinstance(step, torch.Tensor):
        return float(step) if step.device.type == "cpu" else None  # sync point: host memory only
    return float(step)


def _batches(items: list[tuple[int, torch.Tensor, dict]]) -> list[list[tuple[int, torch.Tensor, dict]]]:
    """Consecutive runs of `items` of at most `BATCH_ELEMENTS` entries (a larger parameter alone)."""
    out: list[list[tuple[int, torch.Tensor, dict]]] = []
    size = 0
    for item in items:
        n = item[1].numel()
        if not out or size + n > BATCH_ELEMENTS:
            out.append([])
            size = 0
        out[-1].append(item)
        size += n
    return out


class Workspace:
    """Two float32 buffers of one `update_norms` call on one device, grown to its largest batch and
    reused by every batch (the batches' temporaries are views of them). A fresh pair per batch came
    from fresh pages: on a GPT-2-sized model on a CPU, ~66 000 page faults and ~110 ms of kernel time
    per call, about a third of the call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def views(self, like: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Two lists of float32 tensors shaped like `like`, in the two buffers (contents undefined)."""
        total = sum(t.numel() for t in like)
        if self._buffers is None or self._buffers[0].numel() < total:
            self._buffers = (
                torch.empty(total, device=self.device),
                torch.empty(total, device=self.device),
            )
        out: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for buffer, views in zip(self._buffers, out, strict=True):
            start = 0
            for t in like:
                views.append(buffer[start : start + t.numel()].view(t.shape))
                start += t.numel()
        return out


def _shrink(group: dict, decoupled: bool) -> float:
    """a = lr·wd of decoupled weight decay (θ_new = (1 − a)·θ_old − u), 0 without it."""
    return float(group["lr"]) * group["weight_decay"] if decoupled else 0.0


def read_state(group: dict) -> tuple[str, str]:
    """The state entries `_adam_batch_norms` reads: the first moment and the second (or its max)."""
    return "exp_avg", "max_exp_avg_sq" if group.get("amsgrad") else "exp_avg_sq"


def _adam_batch_norms(
    params: list[torch.Tensor],
    states: list[dict],
    group: dict,
    step: float,
    decoupled: bool,
    seen: FiniteSeen | None,
    space: Workspace,
) -> list[torch.Tensor]:
    """`_adam_delta`'s ‖Δθ‖ for parameters of one group that share a host step count, with foreach
    ops: u = lr/bc1 · m / (√v/√bc2 + ε), ‖Δθ‖ = ‖a·θ_new + u‖ / (1 − a) with a = lr·wd (AdamW).
    `seen`: gets a flag for NaN/±Inf in m, v (and θ when a > 0): u's norms are non-finite when m, v or
    θ is, except v = +Inf (u = 0 there), which the norms of √v + ε show."""
    beta1, beta2 = group["betas"]
    lr, eps = float(group["lr"]), group["eps"]
    bc1, bc2 = 1 - beta1**step, 1 - beta2**step
    first, second = read_state(group)
    # m / (√v/√bc2 + ε) = √bc2 · m / (√v + ε·√bc2): bc2 folds into the scalars, three writing passes
    root = bc2**0.5
    denom, update = space.views(params)
    for d, s in zip(denom, states, strict=True):
        torch.sqrt(s[second].float(), out=d)  # computed in float32 (a no-op cast for float32 state)
    torch._foreach_add_(denom, eps * root)  # √v + ε·√bc2
    if seen is not None:  # a pass over what was just written: in cache
        seen.flags.append(any_nonfinite(foreach_norm_f32(denom)))
    scale = lr * root / bc1
    moments = [s[first].float() for s in states]
    shrink = _shrink(group, decoupled)
    if shrink and scale / shrink < FUSED_DECAY_LIMIT:  # a·θ_new + u = a·(θ_new + (scale/a)·m/d), one pass
        for u, p, m, d in zip(update, params, moments, denom, strict=True):
            torch.addcdiv(p if p.dtype == torch.float32 else p.float(), m, d, value=scale / shrink, out=u)
        norms = _checked_norms(update, seen)
        torch._foreach_mul_(norms, shrink / (1 - shrink))
    elif shrink:  # a·θ_new + u, with a too small to divide by
        for u, p in zip(update, params, strict=True):
            torch.mul(p if p.dtype == torch.float32 else p.float(), shrink, out=u)
        torch._foreach_addcdiv_(update, moments, denom, value=scale)
        norms = _checked_norms(update, seen)
        torch._foreach_div_(norms, 1 - shrink)
    else:
        for u, m, d in zip(update, moments, denom, strict=True):
            torch.div(m, d, out=u)  # u / scale
        norms = _checked_norms(update, seen)
        torch._foreach_mul_(norms, scale)
    return norms


def _checked_norms(update: list[torch.Tensor], seen: FiniteSeen | None) -> list[torch.Tensor]:
    """float32 norms of the rebuilt `update` tensors; `seen` gets a flag when one is NaN/±Inf."""
    norms = foreach_norm_f32(update)
    if seen is not None:
        seen.flags.append(any_nonfinite(norms))
    return norms


def _adam_delta(p: torch.Tensor, group: dict, state: dict, decoupled: bool) -> torch.Tensor:
    """Adam(W): θ_new = (1 − lr·wd_dec)·θ_old − u with u = lr/bc1 · m / (√v/√bc2 + ε)."""
    beta1, beta2 = group["betas"]
    lr, eps = group["lr"], group["eps"]
    step = state["step"]
    step_t = (
        step.to(device=p.device, dtype=torch.float32)
        if isinstance(step, torch.Tensor)
        else torch.tensor(float(step), device=p.device)
    )
    bc1 = 1 - torch.pow(torch.as_tensor(beta1, device=p.device, dtype=torch.float32), step_t)
    bc2 = 1 - torch.pow(torch.as_tensor(beta2, device=p.device, dtype=torch.float32), step_t)
    v = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
    m = state["exp_avg"]
    u = (m.float() * (lr / bc1)) / (v.float().sqrt() / bc2.sqrt() + eps)
    # with maximize=True torch negates the gradient before the moments, so m already carries the sign
    theta = p.detach().float()
    shrink = _shrink(group, decoupled)
    # θ_old = (θ_new + u) / (1 − a)  ⇒  Δ = θ_new − θ_old = (−a·θ_new − u) / (1 − a)
    return (-shrink * theta - u) / (1 - shrink)


def _sgd_delta(p: torch.Tensor, grad: torch.Tensor, group: dict, state: dict) -> torch.Tensor:
    """SGD: Δ = −lr·buf (momentum), or rebuilt from the gradient (plain / Nesterov, with weight decay)."""
    lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
    buf = state.get("momentum_buffer")  # built from the (negated, with maximize) gradient + wd·θ_old
    if mom and buf is not None and not group.get("nesterov"):
        return -lr * buf.float()
    grad = grad.detach().float()
    direction = -grad if group.get("maximize") else grad  # d = ±g + wd·θ_old (+ μ·buf for Nesterov)
    if mom and buf is not None:
        direction = direction + mom * buf.float()
    theta = p.detach().float()
    if not wd:
        return -lr * direction
    # θ_new = θ_old − lr·(direction + wd·θ_old)  ⇒  θ_old = (θ_new + lr·direction) / (1 − lr·wd)
    old = (theta + lr * direction) / (1 - lr * wd)
    return theta - old
