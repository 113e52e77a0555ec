"""‖θ_new − θ_old‖ per parameter without keeping a copy of the parameters.

Runs in the optimizer's step post-hook on sampled steps. For torch's Adam, AdamW and SGD the
update is rebuilt from the optimizer state and the gradient that are still there right after
the step, so the only extra memory is one parameter-sized temporary at a time. Other optimizers
fall back to a snapshot taken in the pre-hook (one copy of the parameters on sampled steps).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..distributed import like_param, local

SUPPORTED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def closed_form_supported(optimizer: Any) -> bool:
    """True when `update_norms` can rebuild the update of every parameter of `optimizer` (one
    optimizer, or an `OptimizerSet` of supported ones)."""
    each = getattr(optimizer, "optimizers", [optimizer])
    if any(type(opt) not in SUPPORTED for opt in each):
        return False
    return all(not g.get("differentiable", False) for g in optimizer.param_groups)


def update_norms(optimizer: Any, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-parameter ‖Δθ‖ (float32 0-d device tensors) of the step that just ran; 0 for skipped params."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    out = []
    for p in params:
        owner = optimizer.owner(p) if hasattr(optimizer, "owner") else optimizer
        group = group_of.get(id(p))
        state = optimizer.state.get(p, {})
        if group is None or p.grad is None or (not state and not isinstance(owner, torch.optim.SGD)):
            out.append(torch.zeros((), device=local(p).device))
            continue
        # FSDP2: this rank's shard of the parameter, its gradient and its state (DTensor.to_local())
        grad = local(like_param(p.grad, p))  # tensor parallel: the gradient in the parameter's layout
        state = {k: local(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()}
        p = local(p)
        if isinstance(owner, torch.optim.SGD):
            delta = _sgd_delta(p, grad, group, state)
        else:
            decoupled = isinstance(owner, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))
            delta = _adam_delta(p, group, state, decoupled=decoupled)
        out.append(torch.linalg.vector_norm(delta, dtype=torch.float32))
    return out


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
    shrink = lr * group["weight_decay"] if decoupled else 0.0
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
