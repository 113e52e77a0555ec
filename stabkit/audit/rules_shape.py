"""Audit rules about shapes: head width, heads against d_model, FFN width against d_model.

Run once per `stabkit.audit` call; they read module shapes only (meta-device models work).
Blocks with the same evidence are reported as one finding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..discovery.roles import in_features, out_features
from .context import AuditContext
from .findings import Finding

MIN_HEAD_DIM = 32
FFN_TOLERANCE = 2.0
"""A ratio d_ff/d_model more than this factor away from its target (4 or 8/3) is reported."""
DOWN_NAMES = ("down_proj", "proj", "c_proj", "w2", "fc2", "dense_4h_to_h", "wo", "linear2", "out_proj")
GATE_NAMES = ("gate_proj", "gate", "w_gate", "gate_up_proj", "wi_0", "w13", "fc_gate")

HEAD_DIM_WHY = (
    "Bhojanapalli et al. 2020: a head narrower than it needs is a low-rank bottleneck on its attention "
    "pattern; practice keeps head_dim at 64-128 and adds heads as the width grows"
)
HEADS_WHY = (
    "practice: d_model = n_heads·head_dim (and kv heads dividing heads for GQA) keeps the projections "
    "splitting into whole heads; a remainder is usually a configuration mistake"
)
FFN_WHY = (
    "practice (Vaswani et al. 2017: d_ff = 4·d_model; Shazeer 2020: gated units use 2/3 of that, "
    "8/3·d_model, for the same parameters): a ratio far off wastes parameters or starves the MLP"
)


def group(items: list[tuple[str, dict[str, Any]]]) -> list[tuple[list[str], dict[str, Any]]]:
    """Group (path, evidence) pairs with equal evidence, keeping first-seen order."""
    out: list[tuple[list[str], dict[str, Any]]] = []
    for path, ev in items:
        for paths, seen in out:
            if seen == ev:
                paths.append(path)
                break
        else:
            out.append(([path], ev))
    return out


def head_dim_small(ctx: AuditContext) -> list[Finding]:
    """Attention heads narrower than 32."""
    firsts = [b.attention for b in ctx.mmap.attention_blocks if b.attention is not None]
    items = [
        (a.path, {"head_dim": a.head_dim, "n_heads": a.n_heads, "min": MIN_HEAD_DIM})
        for a in firsts
        if a.head_dim is not None and a.head_dim < MIN_HEAD_DIM
    ]
    return [
        Finding(
            "head_dim_small",
            "note",
            paths,
            ev,
            HEAD_DIM_WHY,
            [f"n_heads<=d_model/{MIN_HEAD_DIM * 2} (head_dim 64-128)"],
        )
        for paths, ev in group(items)
    ]


def heads_not_dividing(ctx: AuditContext) -> list[Finding]:
    """Heads that do not divide d_model, or kv heads that do not divide heads."""
    d = ctx.mmap.d_model
    items = []
    for a in ctx.mmap.attentions:
        bad_heads = bool(d and a.n_heads and d % a.n_heads)
        bad_kv = bool(a.n_heads and a.n_kv_heads and a.n_heads % a.n_kv_heads)
        if bad_heads or bad_kv:
            items.append((a.path, {"d_model": d, "n_heads": a.n_heads, "n_kv_heads": a.n_kv_heads}))
    return [
        Finding(
            "heads_not_dividing",
            "note",
            paths,
            ev,
            HEADS_WHY,
            ["n_heads dividing d_model, n_kv_heads dividing n_heads"],
        )
        for paths, ev in group(items)
    ]


def mlp_shape(mlp: nn.Module, d_model: int) -> tuple[int, bool] | None:
    """(d_ff, gated) of an MLP module: d_ff is the input width of its down projection."""
    own_in = in_features(mlp)
    if own_in is not None:  # the MLP path names the down projection itself (nn.TransformerEncoderLayer)
        return own_in, False
    children = dict(mlp.named_children())
    gated = any(n in children for n in GATE_NAMES) or {"w1", "w3"} <= set(children)
    downs = [(n, m) for n, m in mlp.named_modules() if n and out_features(m) == d_model]
    if not downs:
        return None
    named = [m for n, m in downs if n.rsplit(".", 1)[-1] in DOWN_NAMES]
    d_ff = in_features(named[0] if named else downs[-1][1])  # else the last one in module order
    return (int(d_ff), gated) if d_ff is not None else None


def ffn_ratio(ctx: AuditContext) -> list[Finding]:
    """MLPs whose d_ff/d_model is more than 2x off 4 (plain) or 8/3 (gated)."""
    d = ctx.mmap.d_model
    if not d:
        return []
    items = []
    for b in ctx.mmap.blocks:
        mlp = ctx.module(b.mlp)
        shape = mlp_shape(mlp, d) if mlp is not None else None
        if shape is None:
            continue
        d_ff, gated = shape
        target = 8 / 3 if gated else 4.0
        ratio = d_ff / d
        if not (1 / FFN_TOLERANCE <= ratio / target <= FFN_TOLERANCE):
            ev = {
                "d_model": d,
                "d_ff": d_ff,
                "ratio": round(ratio, 3),
                "gated": gated,
                "target": round(target, 3),
            }
            items.append((str(b.mlp), ev))
    return [
        Finding(
            "ffn_ratio", "note", paths, ev, FFN_WHY, ["d_ff≈8/3·d_model" if ev["gated"] else "d_ff≈4·d_model"]
        )
        for paths, ev in group(items)
    ]


RULES: dict[str, Callable[[AuditContext], list[Finding]]] = {
    "head_dim_small": head_dim_small,
    "heads_not_dividing": heads_not_dividing,
    "ffn_ratio": ffn_ratio,
}
