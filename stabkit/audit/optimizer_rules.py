"""Audit rules on the optimizer: what it decays, Adam's epsilon, coupled weight decay.

Run once per `stabkit.audit` call, when an optimizer is given. They read `param_groups`
(hyper-parameters and parameter identities), never parameter or state values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .context import AuditContext
from .findings import Finding

MAX_EPS = 1e-6
WD_FIX = "optimizer: weight_decay=0 for embeddings/norms/biases"

WD_WHY = {
    "embeddings": "OLMo 2 (Team OLMo 2024, Fig. 10): taking embeddings out of weight decay lowered the "
    "spike score 0.16 → 0.092",
    "norms": "practice (GPT-2/nanoGPT no-decay groups, OLMo 2): decay pulls norm gains toward zero, shrinking "
    "the signal with no regularising benefit",
    "biases": "practice (GPT-2/nanoGPT no-decay groups): decaying biases only pulls offsets to zero, with no "
    "regularising benefit",
}
EPS_WHY = (
    "Wortsman et al. 2023 §3.4: gradient RMS falls with scale toward Adam's ε and updates then collapse "
    "(ε 1e-6 diverged at 4.8B); OLMo 2 (Team OLMo 2024) lowered ε from 1e-5 to 1e-8 (Fig. 9)"
)
COUPLED_WHY = (
    "Wortsman et al. 2023 §3 (Fig. 6): torch AdamW multiplies decay by the LR (p ← p·(1 − lr·wd)), so an LR "
    "change also changes the decay; independent decay (lr·wd fixed, 1e-4 in the paper) lowers LR sensitivity"
)


def _float(value: Any) -> float | None:
    if isinstance(value, torch.Tensor):
        return None if value.is_meta else float(value)  # sync point: once, at audit time
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _kind(ctx: AuditContext, name: str) -> str | None:
    """'embeddings', 'norms', 'biases' or None for a parameter name."""
    owner = ctx.owner_path(name)
    mod = ctx.modules.get(owner)
    if owner in ctx.mmap.embeddings or isinstance(mod, nn.Embedding):
        return "embeddings"
    if ctx.is_norm_path(owner):
        return "norms"
    if name.rsplit(".", 1)[-1].endswith("bias"):
        return "biases"
    return None


def weight_decay_targets(ctx: AuditContext) -> list[Finding]:
    """Param groups with weight_decay > 0 that hold embeddings, norm gains or biases."""
    if ctx.optimizer is None:
        return []
    hits: dict[str, list[str]] = {"embeddings": [], "norms": [], "biases": []}
    decays: dict[str, set[float]] = {k: set() for k in hits}
    for group in ctx.optimizer.param_groups:
        wd = _float(group.get("weight_decay", 0.0)) or 0.0
        if wd <= 0:
            continue
        for p in group["params"]:
            names = ctx.param_names.get(id(p), [])
            kinds = {k for n in names if (k := _kind(ctx, n))}
            for kind in sorted(kinds):
                hits[kind].append(names[0])
                decays[kind].add(wd)
    out = []
    for kind, where in hits.items():
        if where:
            out.append(
                Finding(
                    rule="weight_decay_targets",
                    severity="risk" if kind == "embeddings" else "note",
                    where=where,
                    evidence={
                        "decayed": kind,
                        "parameters": len(where),
                        "weight_decay": sorted(decays[kind]),
                    },
                    why=WD_WHY[kind],
                    fix=[WD_FIX],
                )
            )
    return out


def adam_eps(ctx: AuditContext) -> list[Finding]:
    """Adam-family param groups with eps >= 1e-6."""
    if ctx.optimizer is None:
        return []
    out = []
    for i, group in enumerate(ctx.optimizer.param_groups):
        eps = _float(group.get("eps"))
        if "betas" in group and eps is not None and eps >= MAX_EPS:
            out.append(
                Finding(
                    rule="adam_eps",
                    severity="risk",
                    where=[f"optimizer.param_groups[{i}]"],
                    evidence={"optimizer": type(ctx.optimizer).__name__, "eps": eps, "max": MAX_EPS},
                    why=EPS_WHY,
                    fix=["adam eps=1e-8"],
                )
            )
    return out


def _coupling(opt: torch.optim.Optimizer, group: dict[str, Any]) -> str | None:
    """'coupled' (AdamW: decay × lr), 'l2' (Adam weight_decay: through the gradient), or None."""
    if "betas" not in group:
        return None
    if isinstance(opt, torch.optim.AdamW) or group.get("decoupled_weight_decay"):
        return "coupled"
    return "l2" if isinstance(opt, torch.optim.Adam) else None


def coupled_weight_decay(ctx: AuditContext) -> list[Finding]:
    """Adam(W) groups whose decay is tied to the LR; reports the effective per-step decay lr·wd."""
    if ctx.optimizer is None:
        return []
    out = []
    for i, group in enumerate(ctx.optimizer.param_groups):
        wd = _float(group.get("weight_decay", 0.0)) or 0.0
        mode = _coupling(ctx.optimizer, group)
        if wd <= 0 or mode is None:
            continue
        lr = ctx.lr if ctx.lr is not None else _float(group.get("lr"))
        evidence: dict[str, Any] = {"optimizer": type(ctx.optimizer).__name__, "mode": mode, "lr": lr}
        evidence["weight_decay"] = wd
        evidence["effective_decay_per_step"] = lr * wd if lr is not None else "unknown (no lr)"
        if mode == "l2":
            evidence["note"] = "Adam's weight_decay is an L2 term divided by √v, not decoupled decay"
        out.append(
            Finding(
                rule="coupled_weight_decay",
                severity="note",
                where=[f"optimizer.param_groups[{i}]"],
                evidence=evidence,
                why=COUPLED_WHY,
                fix=[
                    "optimizer: independent weight decay (keep lr·wd fixed, e.g. 1e-4, when the LR changes)"
                ],
            )
        )
    return out


RULES: dict[str, Callable[[AuditContext], list[Finding]]] = {
    "weight_decay_targets": weight_decay_targets,
    "adam_eps": adam_eps,
    "coupled_weight_decay": coupled_weight_decay,
}
