"""Audit rules for the two softmaxes: attention (QK-norm / soft cap) and output (z-loss / soft cap).

Run once per `stabkit.audit` call. A guard is recognised from the reference GPT's config,
q/k norm submodules (Qwen3 / OLMo 2 style names), HF config attributes, the markers stabkit's
interventions leave on modules, and the `active_interventions` the user passes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from .context import AuditContext
from .findings import Finding

QK_NORM_NAMES = (
    "q_norm", "k_norm", "q_layernorm", "k_layernorm", "query_layernorm", "key_layernorm",
    "q_ln", "k_ln", "query_norm", "key_norm", "qk_norm", "q_layer_norm", "k_layer_norm",
    "stabkit_qk_norm",  # added by stabkit.interventions qk_norm
)  # fmt: skip
ATTN_CAP_ATTRS = (
    "_stabkit_attn_softcap",
    "softcap",
    "attn_softcap",
    "attn_logit_softcapping",
    "logit_softcapping",
)
ATTN_CAP_CONFIG = ("attn_softcap", "attn_logit_softcapping")
QK_NORM_CONFIG = ("qk_norm", "qk_layernorm", "use_qk_norm", "qk_ln")
FINAL_CAP_CONFIG = ("logit_softcap", "final_logit_softcapping")
HEAD_MARKERS = ("_stabkit_logit_softcap", "_stabkit_z_loss")

ATTN_WHY = (
    "Wortsman et al. 2023 (Figs. 1-2) and ViT-22B (Dehghani et al. 2023 §2): without QK-norm, attention "
    "logits grow with ‖q‖·‖k‖ until the softmax turns one-hot and training diverges, at lower LRs the "
    "larger the model"
)
OUTPUT_WHY = (
    "Wortsman et al. 2023 (Fig. 4) and PaLM (Chowdhery et al. 2022) §5: output logits drift and log Z "
    "diverges (seen without weight decay at every scale); z-loss 1e-4·log²Z or a final soft cap "
    "(Gemma 2: 30) keeps it bounded"
)


def _set(value: Any) -> bool:
    return value is not None and value is not False and value != 0


def _qk_norm_modules(ctx: AuditContext, attn_path: str) -> list[str]:
    attn = ctx.modules[attn_path]
    return [
        f"{attn_path}.{n}" for n, m in attn.named_modules() if n and n.rsplit(".", 1)[-1] in QK_NORM_NAMES
    ]


def _attn_cap(attn: nn.Module) -> tuple[str, Any] | None:
    for attr in ATTN_CAP_ATTRS:
        value = getattr(attn, attr, None)
        if _set(value) and not isinstance(value, nn.Module) and not callable(value):
            return attr, value
    return None


def attn_softmax_unguarded(ctx: AuditContext) -> list[Finding]:
    """Attention modules with neither QK-norm nor a soft cap on their logits."""
    if ctx.active & {"qk_norm", "attn_softcap"}:
        return []
    cfg_cap = ctx.config_value(*ATTN_CAP_CONFIG)
    cfg_qk = ctx.config_value(*QK_NORM_CONFIG)
    if (cfg_cap and _set(cfg_cap[1])) or (cfg_qk and _set(cfg_qk[1])):
        return []
    unguarded: list[str] = []
    for b in ctx.mmap.attention_blocks:
        assert b.attention is not None
        path = b.attention.path
        attn = ctx.modules[path]
        if _qk_norm_modules(ctx, path) or _attn_cap(attn) or _set(getattr(attn, "_stabkit_qk_norm", None)):
            continue
        unguarded.append(path)
    if not unguarded:
        return []
    first = ctx.mmap.first_attention
    assert first is not None
    return [
        Finding(
            rule="attn_softmax_unguarded",
            severity="risk",
            where=unguarded,
            evidence={
                "qk_norm": False,
                "attn_softcap": None,
                "impl": first.impl,
                "head_dim": first.head_dim,
                "d_model": ctx.mmap.d_model,
                **({"lr": ctx.lr} if ctx.lr is not None else {}),
            },
            why=ATTN_WHY,
            fix=["qk_norm", "attn_softcap"],
        )
    ]


def output_softmax_unguarded(ctx: AuditContext) -> list[Finding]:
    """An output head with neither z-loss nor a final soft cap."""
    if ctx.active & {"z_loss", "logit_softcap"}:
        return []
    cap = ctx.config_value(*FINAL_CAP_CONFIG)
    if cap and _set(cap[1]):
        return []
    head_path = ctx.mmap.output_head
    owners = [ctx.model] + ([ctx.modules[head_path]] if head_path in ctx.modules else [])
    if any(_set(getattr(o, m, None)) for o in owners for m in HEAD_MARKERS):
        return []
    return [
        Finding(
            rule="output_softmax_unguarded",
            severity="risk",
            where=[head_path or "<output>"],
            evidence={
                "z_loss": "not seen (in your own loss? pass active_interventions=['z_loss'])",
                "logit_softcap": None,
                "vocab_size": ctx.mmap.vocab_size,
            },
            why=OUTPUT_WHY,
            fix=["z_loss", "logit_softcap"],
        )
    ]


RULES: dict[str, Callable[[AuditContext], list[Finding]]] = {
    "attn_softmax_unguarded": attn_softmax_unguarded,
    "output_softmax_unguarded": output_softmax_unguarded,
}
