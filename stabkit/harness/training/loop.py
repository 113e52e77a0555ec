"""Training loop for the reference GPT: AdamW (0.9, 0.95), warmup then cosine, grad clipping.

Follows Wortsman et al. 2023 §2.1 at small scale (see shared/reference/papers.md, CPU proxy).
Runs in the caller's process. The loop knows nothing of monitoring: the caller attaches a monitor
to the model and the optimizer it passes in, and steps it from `after_update`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ...tables import bounds
from ..data import ByteCorpus

Precision = Literal["fp32", "bf16", "fp16"]

MAX_BATCH_SIZE = 4096
"""The largest `batch_size` (sequences per micro-batch) a recipe may ask for."""


@dataclass
class TrainConfig:
    """Optimiser, schedule, length and precision of one run.

    The ranges in the fields' metadata are checked when a recipe fills the config
    (`stabkit.tables.fill`); `__post_init__` checks what the loop itself needs.
    """

    steps: int = field(default=300, metadata=bounds(lo=1))
    """Optimizer steps."""
    batch_size: int = field(
        default=16,
        metadata=bounds(
            lo=1,
            hi=MAX_BATCH_SIZE,
            hint="sequences per micro-batch; for a larger batch per optimizer step set train.grad_accum "
            "(micro-batches per step)",
        ),
    )
    """Sequences per micro-batch."""
    lr: float = field(default=1e-2, metadata=bounds(lo=0.0, lo_open=True))
    """Peak learning rate."""
    warmup: int = field(default=15, metadata=bounds(lo=0))
    """Linear warmup steps (0 = none)."""
    min_lr_fraction: float = field(default=0.01, metadata=bounds(lo=0.0, hi=1.0))
    """Cosine decay ends at this fraction of the peak."""
    weight_decay: float = field(default=1e-4, metadata=bounds(lo=0.0))
    """Weight decay on matrices (not on embeddings, norms, biases)."""
    independent_decay: bool = True
    """Decay independent of the peak LR (Wortsman et al. 2023 Fig. 6); False = torch AdamW coupling."""
    betas: tuple[float, float] = field(default=(0.9, 0.95), metadata=bounds(lo=0.0, hi=1.0, hi_open=True))
    """Adam betas."""
    eps: float = field(default=1e-8, metadata=bounds(lo=0.0, lo_open=True))
    """Adam epsilon."""
    clip: float | None = field(default=1.0, metadata=bounds(lo=0.0, lo_open=True))
    """Global grad-norm clip (None = off; "none" in a recipe)."""
    seed: int = field(default=0, metadata=bounds(lo=0))
    """Seed of the model init and of the data order."""
    eval_batches: int = field(default=8, metadata=bounds(lo=1))
    """Validation batches at the end."""
    eval_every: int = field(default=0, metadata=bounds(lo=0))
    """Also measure the held-out loss every this many steps (0 = only before and after training); the
    recipes' worker records the curve (``val_curve``), which the lead-time table reads. Evaluation
    runs without gradients in eval mode, on its own batches: training is unchanged."""
    grad_accum: int = field(default=1, metadata=bounds(lo=1))
    """Micro-batches per optimizer step."""
    precision: Precision = "fp32"
    """fp32, or bf16 / fp16 autocast on the forward pass (the caller sets it up: the recipes' worker
    with `stabkit.harness.recipes.faults.autocast_forward`)."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("TrainConfig.steps, batch_size and grad_accum must be >= 1")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"TrainConfig.lr must be a positive number, got {self.lr!r}")
        if self.warmup < 0 or self.weight_decay < 0 or self.eps <= 0:
            raise ValueError("TrainConfig.warmup and weight_decay must be >= 0 and eps > 0")
        if self.clip is not None and self.clip <= 0:
            raise ValueError(f"TrainConfig.clip must be None or > 0, got {self.clip!r}")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"TrainConfig.precision must be fp32, bf16 or fp16, got {self.precision!r}")


@dataclass
class TrainResult:
    """What one run produced (host floats)."""

    losses: list[float]
    val_loss: float = math.nan
    """Validation loss at the end (NaN when `train` was asked not to evaluate)."""

    @property
    def diverged(self) -> bool:
        """A non-finite training or validation loss."""
        return not math.isfinite(self.val_loss) or any(not math.isfinite(v) for v in self.losses)

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
    optimizer: torch.optim.Optimizer | None = None,
    after_update: Callable[[torch.Tensor], None] | None = None,
    on_step: Callable[[int, float], None] | None = None,
    on_end: Callable[[], None] | None = None,
    evaluate_at_end: bool = True,
    device: str | torch.device = "cpu",
) -> TrainResult:
    """Train `model` on `corpus`; returns per-step losses and (`evaluate_at_end`) a validation loss.

    `optimizer`: built by the caller (e.g. to attach a monitor to it first; default
    `make_optimizer(model, cfg)`). `after_update(loss)` runs after each optimizer step with the
    step's loss (a 0-d device tensor), before the gradients are cleared: the place for
    ``monitor.step``. `on_step(step, loss)` is called with the host loss each step. `on_end()` runs
    when the loop ends, also when it raises, before the validation: the place for
    ``monitor.detach``. The loop builds no monitor and registers no hooks.
    """
    opt = optimizer if optimizer is not None else make_optimizer(model, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    losses: list[float] = []
    try:
        for step in range(cfg.steps):
            for group in opt.param_groups:  # lr_scale: a factor stabkit's rescue may have set
                group["lr"] = lr_at(step, cfg) * group.get("lr_scale", 1.0)
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
            if after_update is not None:
                after_update(total)
            opt.zero_grad(set_to_none=True)
            value = float(total)  # sync point: the loop reports the loss each step
            losses.append(value)
            if on_step is not None:
                on_step(step, value)
    finally:
        if on_end is not None:
            on_end()
    if not evaluate_at_end:
        return TrainResult(losses)
    return TrainResult(losses, evaluate(model, corpus, cfg, context, gen, device))


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
