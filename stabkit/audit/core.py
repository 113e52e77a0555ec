"""`stabkit.audit(model, optimizer)`: run every rule once and return a Report.

Runs once, before training (from user code, from `attach`, or from `stabkit inspect --audit`).
It reads module types, shapes, flags and optimizer hyper-parameters; it never reads tensor values
on a meta-device model and never touches the training hot path.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..discovery import ModelMap, inspect_model
from . import optimizer_rules, rules_norm, rules_regularization, rules_shape, rules_softmax
from .context import AuditContext, applied_interventions
from .findings import INTERVENTIONS, Finding, Report
from .memory import summarize

Rule = Callable[[AuditContext], list[Finding]]

RULES: dict[str, Rule] = {
    **rules_norm.RULES,
    **rules_softmax.RULES,
    **rules_shape.RULES,
    **rules_regularization.RULES,
    **optimizer_rules.RULES,
}
"""Rule id -> function(AuditContext) -> findings. Add a rule by adding an entry."""


def audit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    lr: float | None = None,
    warmup_steps: int | None = None,
    seq_len: int | None = None,
    model_map: ModelMap | None = None,
    active_interventions: Iterable[str] | None = None,
    kv_dtype: torch.dtype | None = None,
    rules: Iterable[str] | None = None,
) -> Report:
    """Audit `model` (and `optimizer`) for choices that put a training run at risk.

    lr / warmup_steps: the run's peak LR and warmup (warmup None counts as none, for post-norm).
    seq_len: sequence length for the KV-cache figure (default: the model's context length).
    model_map: a ModelMap from `stabkit.inspect_model` (found here when None).
    active_interventions: names of guards the model cannot show (e.g. ``['z_loss']`` in your loss);
        interventions applied with `stabkit.interventions.apply` are seen without it.
    kv_dtype: dtype of the KV cache (default: the key projection's dtype).
    rules: ids of the rules to run (default: all of RULES).
    A rule that fails warns and is skipped; it never stops the caller.
    """
    given = frozenset(active_interventions or ())
    unknown = sorted(given - set(INTERVENTIONS))
    if unknown:
        raise ValueError(f"unknown active_interventions {unknown}; allowed: {list(INTERVENTIONS)}")
    active = given | applied_interventions(model)
    selected = list(RULES) if rules is None else list(rules)
    missing = [r for r in selected if r not in RULES]
    if missing:
        raise ValueError(f"unknown audit rule(s) {missing}; available: {sorted(RULES)}")
    if lr is not None and not lr > 0:
        raise ValueError(f"lr must be a positive number or None, got {lr!r}")
    if warmup_steps is not None and warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0 or None, got {warmup_steps!r}")
    if seq_len is not None and seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer or None, got {seq_len!r}")
    mmap = model_map if model_map is not None else inspect_model(model)
    ctx = AuditContext(model, mmap, optimizer, lr, warmup_steps, seq_len, active, kv_dtype)
    findings: list[Finding] = []
    for rule_id in selected:
        try:
            findings.extend(RULES[rule_id](ctx))
        except Exception as exc:  # a broken rule must not stop attach() or the CLI
            warnings.warn(f"stabkit audit rule {rule_id!r} failed and was skipped: {exc!r}", stacklevel=2)
    return Report(findings=findings, memory=summarize(ctx), family=mmap.family, inputs=_inputs(ctx))


def describe_rules() -> dict[str, str]:
    """Rule id -> one line saying what it flags (for `stabkit list`)."""
    return {
        name: (fn.__doc__ or "").strip().splitlines()[0] if fn.__doc__ else "" for name, fn in RULES.items()
    }


def _inputs(ctx: AuditContext) -> dict[str, Any]:
    return {
        "optimizer": type(ctx.optimizer).__name__ if ctx.optimizer is not None else None,
        "lr": ctx.lr,
        "warmup_steps": ctx.warmup_steps,
        "seq_len": ctx.seq_len,
        "active_interventions": sorted(ctx.active),
        "meta_device": ctx.is_meta,
    }
