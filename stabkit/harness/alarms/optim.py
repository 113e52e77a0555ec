"""Optimizers and learning-rate schedules of the healthy-run corpus, made once per run.

Schedules are `torch.optim.lr_scheduler.LambdaLR` multipliers, so each optimizer's
``param_groups[i]["lr"]`` changes every step as in a real loop (the monitor is told nothing about them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

OPTIMIZERS: tuple[str, ...] = ("adamw", "adam_eps", "sgd", "adafactor", "muon")
SCHEDULES: tuple[str, ...] = ("cosine", "wsd", "constant", "invsqrt", "warmup")

_NOT_HIDDEN = ("emb", "wte", "wpe", "tok", "pos", "head", "lm_head", "embed")


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """A 2-D weight inside the blocks (attention and MLP projections): Muon's and μP's hidden matrices."""
    parts = name.split(".")
    return p.dim() == 2 and not any(part.startswith(_NOT_HIDDEN) for part in parts)


def make_optimizers(
    model: nn.Module, kind: str, lr: float, muon_lr: float = 0.02, mup_width: int | None = None
) -> list[torch.optim.Optimizer]:
    """The run's optimizers (one, or Muon + AdamW). `mup_width`: μP's hidden learning rates ×32/width."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hidden = [p for n, p in named if is_hidden_matrix(n, p)]
    hidden_ids = {id(p) for p in hidden}
    matrices = [p for _, p in named if p.dim() >= 2 and id(p) not in hidden_ids]
    vectors = [p for _, p in named if p.dim() < 2]
    if kind == "muon":
        return [
            torch.optim.Muon(hidden, lr=muon_lr, weight_decay=0.0),
            torch.optim.AdamW(matrices + vectors, lr=lr, betas=(0.9, 0.95), weight_decay=0.0),
        ]
    scale = 32 / mup_width if mup_width else 1.0
    wd = 0.1 if kind == "adamw" else 0.0
    groups: list[dict[str, Any]] = [
        {"params": hidden, "lr": lr * scale, "weight_decay": wd},
        {"params": matrices, "lr": lr, "weight_decay": wd},
        {"params": vectors, "lr": lr, "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if kind == "adamw":
        return [torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))]
    if kind == "adam_eps":
        return [torch.optim.Adam(groups, lr=lr, eps=1e-10)]
    if kind == "sgd":
        return [torch.optim.SGD(groups, lr=lr, momentum=0.9)]
    if kind == "adafactor":
        return [torch.optim.Adafactor(groups, lr=lr)]
    raise ValueError(f"unknown optimizer {kind!r}; choose one of {', '.join(OPTIMIZERS)}")


def schedule(kind: str, steps: int, warmup: int) -> Callable[[int], float]:
    """The LR multiplier at optimizer step s (0-based): linear warmup over `warmup` steps, then `kind`."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")

    def f(s: int) -> float:
        if warmup and s < warmup:
            return (s + 1) / warmup
        after, span = s - warmup, max(1, steps - warmup)
        if kind == "cosine":
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, after / span)))
        if kind == "wsd":  # warmup, stable, then linear decay to 0 over the last 20 %
            start = int(steps * 0.8)
            return 1.0 if s < start else max(0.0, (steps - s) / max(1, steps - start))
        if kind == "invsqrt":
            return math.sqrt(max(1, warmup) / (max(1, warmup) + after))
        return 1.0  # constant; warmup: constant after the warmup

    return f


def make_schedulers(
    optimizers: list[torch.optim.Optimizer], kind: str, steps: int, warmup: int
) -> list[torch.optim.lr_scheduler.LambdaLR]:
    """One LambdaLR per optimizer (each scales its groups' own base learning rates)."""
    return [torch.optim.lr_scheduler.LambdaLR(o, schedule(kind, steps, warmup)) for o in optimizers]
