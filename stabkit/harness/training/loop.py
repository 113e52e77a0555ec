"""Training loop for the reference GPT: AdamW (0.9, 0.95), warmup then cosine, grad clipping.

Follows Wortsman et al. 2023 §2.1 at small scale (see shared/reference/papers.md, CPU proxy).
Runs in the caller's process; a Monitor, if given, is stepped once per optimizer step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ...monitor import Monitor
from ..data import ByteCorpus


@dataclass
class TrainConfig:
    """Optimiser, schedule and length of one run."""

    steps: int = 300
    """Optimizer steps."""
    batch_size: int = 16
    """Sequences per step."""
    lr: float = 1e-2
    """Peak learning rate."""
    warmup: int = 15
    """Linear warmup steps (0 = none)."""
    min_lr_fraction: float = 0.01
    """Cosine decay ends at this fraction of the peak."""
    weight_decay: float = 1e-4
    """Weight decay on matrices (not on embeddings, norms, biases)."""
    independent_decay: bool = True
    """Decay independent of the peak LR (Wortsman et al. 2023 Fig. 6); False = torch AdamW coupling."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip: float | None = 1.0
    """Global grad-norm clip (None = off)."""
    seed: int = 0
    """Seed of the model init and of the data order."""
    eval_batches: int = 8
    """Validation batches at the end."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    extra: dict[str, float] = field(default_factory=dict)
    """Free-form numbers recipes attach (ignored by the loop)."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("TrainConfig.steps, batch_size and grad_accum must be >= 1")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"TrainConfig.lr must be a positive number, got {self.lr!r}")
        if self.warmup < 0 or self.weight_decay < 0 or self.eps <= 0:
            raise ValueError("TrainConfig.warmup and weight_decay must be >= 0 and eps > 0")
        if self.clip is not None and self.clip <= 0:
            raise ValueError(f"TrainConfig.clip must be None or > 0, got {self.clip!r}")


@dataclass
class TrainResult:
    """What one run produced (host floats)."""

    losses: list[float]
    val_loss: float
    diverged: bool

    @property
    def initial_loss(self) -> float:
        return self.losses[0]

    @property
    def final_loss(self) -> float:
        """Mean of the last 10 % of training losses (less noisy than the last one)."""
        tail = self.losses[-max(1, len(self.losses) // 10) :]
        return sum(tail) / len(tail)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate at `step`: linear warmup, then cosine to `min_lr_fraction` of the peak."""
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    progress = min(1.0, (step - cfg.warmup) / span)
    floor = cfg.min_lr_fraction
    return cfg.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with decay on ≥2-D non-embedding weights only; independent decay divides by the peak LR."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "emb" not in name else no_decay).append(p)
    wd = cfg.weight_decay / cfg.lr if cfg.independent_decay else cfg.weight_decay
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def train(
    model: nn.Module,
    corpus: ByteCorpus,
    cfg: TrainConfig,
    *,
    context: int,
    monitor_factory: Callable[[nn.Module, torch.optim.Optimizer], Monitor] | None = None,
    on_step: Callable[[int, float], None] | None = None,
    device: str | torch.device = "cpu",
) -> TrainResult:
    """Train `model` on `corpus`; returns per-step losses and a final validation loss.

    `monitor_factory(model, optimizer)` builds a Monitor (stepped each step, detached at the end,
    also when training raises). `on_step(step, loss)` is called with the host loss each step.
    """
    opt = make_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    monitor = monitor_factory(model, opt) if monitor_factory else None
    losses: list[float] = []
    try:
        for step in range(cfg.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            total = torch.zeros((), device=device)
            for _ in range(cfg.grad_accum):
                x, y = corpus.batch("train", cfg.batch_size, context, gen)
                x, y = x.to(device), y.to(device)
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
                (loss / cfg.grad_accum).backward()
                total += loss.detach() / cfg.grad_accum
            if cfg.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
            opt.step()
            if monitor is not None:
                monitor.step(total)
            opt.zero_grad(set_to_none=True)
            value = float(total)  # sync point: the loop reports the loss each step
            losses.append(value)
            if on_step is not None:
                on_step(step, value)
    finally:
        if monitor is not None:
            monitor.detach()
    val = evaluate(model, corpus, cfg, context, gen, device)
    bad = not math.isfinite(val) or any(not math.isfinite(v) for v in losses)
    return TrainResult(losses=losses, val_loss=val, diverged=bad)


@torch.no_grad()
def evaluate(
    model: nn.Module,
    corpus: ByteCorpus,
    cfg: TrainConfig,
    context: int,
    gen: torch.Generator,
    device: str | torch.device,
) -> float:
    """Mean validation loss over `cfg.eval_batches` batches."""
    was_training = model.training
    model.eval()
    total = 0.0
    for _ in range(cfg.eval_batches):
        x, y = corpus.batch("val", cfg.batch_size, context, gen)
        logits = model(x.to(device))
        total += float(
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.to(device).reshape(-1))
        )
    model.train(was_training)
    return total / cfg.eval_batches
