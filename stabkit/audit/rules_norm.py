"""Audit rules about normalisation: placement per block, warmup with post-norm, LayerNorm bias.

Each rule runs once per `stabkit.audit` call and reads module types and flags; the only
value it reads (whether a LayerNorm bias is non-zero) is skipped on the meta device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..discovery.roles import norm_kind
from .context import AuditContext
from .findings import Finding

XIONG = (
    "Xiong et al. 2020 (Theorem 1): post-LN gradients at the last layers are large at init "
    "(O(d·√ln d), not shrinking with depth), so it needs a learning-rate warmup; pre-LN does not"
)
XIONG_WARMUP = (
    "Xiong et al. 2020 §3.2: post-LN without warmup reached BLEU 8.45 against about 34 with 4,000 warmup "
    "steps, because its last-layer gradients are large at init"
)
RMSNORM_WHY = (
    "practice (Zhang & Sennrich 2019, RMSNorm; PaLM §2 drops norm biases for stability): the mean "
    "subtraction and bias cost memory traffic and parameters for no measurable gain"
)


def _post_blocks(ctx: AuditContext) -> list[str]:
    return [b.path for b in ctx.mmap.blocks if b.placement == "post"]


def post_norm(ctx: AuditContext) -> list[Finding]:
    """Blocks whose norm sits after the residual add (post-LN)."""
    blocks = _post_blocks(ctx)
    if not blocks:
        return []
    norms = [n.path for b in ctx.mmap.blocks if b.path in blocks for n in b.norms if n.position == "post"]
    return [
        Finding(
            rule="post_norm",
            severity="note",
            where=blocks,
            evidence={"placement": "post", "blocks": len(blocks), "of": len(ctx.mmap.blocks), "norms": norms},
            why=XIONG,
            fix=["norm_placement(to=pre)", "norm_placement(to=sandwich)"],
        )
    ]


def post_norm_no_warmup(ctx: AuditContext) -> list[Finding]:
    """Post-LN blocks with no warmup (warmup_steps 0 or not given)."""
    blocks = _post_blocks(ctx)
    if not blocks or (ctx.warmup_steps is not None and ctx.warmup_steps > 0):
        return []
    return [
        Finding(
            rule="post_norm_no_warmup",
            severity="risk",
            where=blocks,
            evidence={
                "placement": "post",
                "warmup_steps": ctx.warmup_steps if ctx.warmup_steps is not None else "not given",
            },
            why=XIONG_WARMUP,
            fix=["warmup_steps>=4000", "norm_placement(to=pre)", "norm_placement(to=sandwich)"],
        )
    ]


def _ln_bias(mod: nn.Module) -> torch.Tensor | None:
    bias = getattr(mod, "bias", None)
    return bias if isinstance(bias, torch.Tensor) and norm_kind(mod) == "layernorm" else None


def layernorm_bias(ctx: AuditContext) -> list[Finding]:
    """LayerNorms that carry a bias, where an RMSNorm (no mean, no bias) would do."""
    found = [(path, b) for path, mod in ctx.modules.items() if (b := _ln_bias(mod)) is not None]
    if not found:
        return []
    evidence: dict[str, object] = {
        "layernorms_with_bias": len(found),
        "bias_shape": list(found[0][1].shape),
    }
    if ctx.is_meta:
        evidence["nonzero_bias"] = "unknown (meta device)"
    else:
        # sync point: one read per LayerNorm, once at audit time (never on the training hot path)
        evidence["nonzero_bias"] = sum(bool(b.detach().ne(0).any()) for _, b in found)
    return [
        Finding(
            rule="layernorm_bias",
            severity="note",
            where=[p for p, _ in found],
            evidence=evidence,
            why=RMSNORM_WHY,
            fix=["rmsnorm"],
        )
    ]


RULES: dict[str, Callable[[AuditContext], list[Finding]]] = {
    "post_norm": post_norm,
    "post_norm_no_warmup": post_norm_no_warmup,
    "layernorm_bias": layernorm_bias,
}
