"""Audit rules for leftovers of older recipes: biases in linear layers, dropout above zero.

Run once per `stabkit.audit` call; they read module types, parameter shapes and config flags.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..discovery.roles import out_features
from .context import AuditContext
from .findings import Finding

DROPOUT_MODULE_ATTRS = (
    "dropout",
    "attention_dropout",
    "attn_dropout",
    "dropout_p",
    "attn_pdrop",
    "resid_pdrop",
)
DROPOUT_CONFIG_ATTRS = (
    "dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "attention_dropout", "hidden_dropout",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "embedding_dropout", "activation_dropout",
    "ffn_dropout", "residual_dropout",
)  # fmt: skip

BIAS_WHY = (
    "PaLM (Chowdhery et al. 2022) §2: no biases in dense kernels or layer norms increased training "
    "stability for large models (and saves parameters and memory traffic)"
)
DROPOUT_WHY = (
    "PaLM (Chowdhery et al. 2022) §5 pre-trained without dropout: a single pass over the data rarely "
    "overfits, so dropout only adds noise and slows learning"
)


def _linear_bias(path: str, mod: nn.Module) -> list[tuple[str, list[int]]]:
    """(path, bias shape) of a linear-like module's bias parameters."""
    if isinstance(mod, nn.MultiheadAttention):
        in_bias = mod.in_proj_bias
        return [(f"{path}.in_proj_bias", list(in_bias.shape))] if in_bias is not None else []
    if out_features(mod) is None:
        return []
    bias = getattr(mod, "bias", None)
    return [(path, list(bias.shape))] if isinstance(bias, torch.Tensor) else []


def linear_bias(ctx: AuditContext) -> list[Finding]:
    """Linear layers (nn.Linear, HF Conv1D, MultiheadAttention in_proj) that carry a bias."""
    found = [hit for path, mod in ctx.modules.items() if path for hit in _linear_bias(path, mod)]
    if not found:
        return []
    n_bias = sum(int(torch.Size(shape).numel()) for _, shape in found)
    return [
        Finding(
            rule="linear_bias",
            severity="note",
            where=[p for p, _ in found],
            evidence={"linears_with_bias": len(found), "bias_parameters": n_bias},
            why=BIAS_WHY,
            fix=["bias=False in linear layers"],
        )
    ]


def _rate(value: Any) -> float | None:
    """A positive dropout rate, or None."""
    if isinstance(value, float | int) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def dropout(ctx: AuditContext) -> list[Finding]:
    """nn.Dropout modules with p > 0, dropout rates on attention modules, and dropout config fields."""
    where: list[str] = []
    rates: list[float] = []
    for path, mod in ctx.modules.items():
        if isinstance(mod, nn.Dropout) and mod.p > 0:
            where.append(path or "<root>")
            rates.append(float(mod.p))
            continue
        for attr in DROPOUT_MODULE_ATTRS:
            rate = _rate(getattr(mod, attr, None))
            if rate is not None:
                where.append(f"{path}.{attr}" if path else attr)
                rates.append(rate)
    n_modules = len(where)
    config: dict[str, float] = {}
    for i, cfg in enumerate(ctx.configs):
        for attr in DROPOUT_CONFIG_ATTRS:
            rate = _rate(getattr(cfg, attr, None))
            if rate is not None:
                name = f"config.{attr}" if i == 0 else f"config[{i}].{attr}"
                where.append(name)
                config[name] = rate
    if not where:
        return []
    return [
        Finding(
            rule="dropout",
            severity="note",
            where=where,
            evidence={"max_rate": max(rates + list(config.values())), "modules": n_modules, "config": config},
            why=DROPOUT_WHY,
            fix=["dropout=0 for pre-training"],
        )
    ]


RULES: dict[str, Callable[[AuditContext], list[Finding]]] = {
    "linear_bias": linear_bias,
    "dropout": dropout,
}
