"""Training loop for the reference GPT: AdamW (0.9, 0.95) — or Muon on the hidden matrices with AdamW
for the rest —, warmup then cosine, grad clipping, and the run's precision (autocast around the forward pass and the loss, a GradScaler for fp16 on a GPU).

Follows Wortsman et al. 2023 §2.1 at small scale (see shared/reference/papers.md, CPU proxy).
Runs in the caller's process. The loop knows nothing of monitoring: the caller builds a `TrainRun`,
attaches a monitor to its model and optimizer (with ``scaler=run.amp.scaler``), and steps the monitor
from `Callbacks.after_update`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config import TrainConfig
from .precision import Amp


class Corpus(Protocol):
    """Where batches come from (`stabkit.harness.data.ByteCorpus`, or a wrapper of one)."""

    def batch(
        self, split: str, batch_size: int, context: int, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class Callbacks:
    """What the caller runs inside the loop (each optional)."""

    after_update: Callable[[torch.Tensor], None] | None = None
    """``after_update(loss)`` after each optimizer step, with the step's loss (a 0-d device tensor),
    before the gradients are cleared: the place for ``monitor.step``."""
    on_step: Callable[[int, float], None] | None = None
    """``on_step(step, loss)`` with the host loss after each step (may raise to end training)."""
    on_end: Callable[[], None] | None = None
    """``on_end()`` when the loop ends, also when it raises: the place for ``monitor.detach``."""


@dataclass
class TrainRun:
    """What `train` trains and with what: built once by the caller, who may attach a monitor to
    `model` and `optimizer` (passing ``amp.scaler``) before training starts."""

    model: nn.Module
    """What trains (already on `device`; may be a DDP wrap)."""
    corpus: Corpus
    """Where the training batches come from."""
    config: TrainConfig
    context: int
    """Sequence length of a batch."""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    optimizer: Any = field(init=False)
    """`make_optimizer(model, config)`: one torch optimizer, or a list (Muon and AdamW), which
    ``stabkit.attach`` takes as is."""
    amp: Amp = field(init=False)
    """`config.precision` on `device` (autocast, and for fp16 a GradScaler on a GPU or when
    `config.grad_scaler` asks for one)."""

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        self.optimizer = make_optimizer(self.model, self.config)
        self.amp = Amp.of(self.config.precision, self.device, scaler=self.config.grad_scaler)


@dataclass
class TrainResult:
    """What one run produced (host floats)."""

    losses: list[float]
    """The training loss of each completed step."""

    @property
    def diverged(self) -> bool:
        """A non-finite training loss."""
        return any(not math.isfinite(v) for v in self.losses)

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


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> Any:
    """AdamW with decay on ≥2-D non-embedding weights only; independent decay divides by the peak LR.

    With ``cfg.optimizer == "muon"``: ``[Muon, AdamW]`` — `torch.optim.Muon` on the 2-D weights inside
    the blocks (the hidden matrices: attention and MLP projections), at ``cfg.muon_lr`` (its groups
    carry ``lr_ratio`` = muon_lr / lr, which the loop's schedule multiplies in), and AdamW on the rest
    (embeddings, norms, biases, the output head)."""
    muon = cfg.optimizer == "muon"
    matrices: list[nn.Parameter] = []
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if muon and p.dim() == 2 and _in_blocks(name):
            matrices.append(p)
        else:
            (decay if p.dim() >= 2 and "emb" not in name else no_decay).append(p)
    wd = cfg.weight_decay / cfg.lr if cfg.independent_decay else cfg.weight_decay
    groups = [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]
    adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
    if not muon:
        return adamw
    muon_lr = cfg.muon_lr or cfg.lr
    muon_wd = cfg.weight_decay / muon_lr if cfg.independent_decay else cfg.weight_decay
    ratio = muon_lr / cfg.lr
    hidden = torch.optim.Muon(
        [{"params": matrices, "lr_ratio": ratio}],
        lr=muon_lr,
        weight_decay=muon_wd,
        momentum=cfg.muon_momentum,
        adjust_lr_fn=cfg.muon_adjust_lr,
    )
    return [hidden, adamw]


def _in_blocks(name: str) -> bool:
    """A parameter of a Transformer block (``blocks.<i>.…``), not an embedding, final norm or head."""
    return name.startswith("blocks.") or ".blocks." in name


def optimizers(opt: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers of `TrainRun.optimizer` (one, or a list)."""
    return list(opt) if isinstance(opt, list | tuple) else [opt]


def train(run: TrainRun, callbacks: Callbacks | None = None) -> TrainResult:
    """Train `run.model` for ``run.config.steps`` steps; returns the per-step losses.

    Evaluation is the caller's (`stabkit.harness.training.evaluate`, in the same precision). The
    loop builds no monitor and registers no hooks.
    """
    cb = callbacks or Callbacks()
    cfg, model, amp, opt = run.config, run.model, run.amp, run.optimizer
    gen = torch.Generator().manual_seed(cfg.seed)
    losses: list[float] = []
    try:
        for step in range(cfg.steps):
            for group in (g for o in optimizers(opt) for g in o.param_groups):
                # the schedule (Muon's groups at their lr_ratio); a rescue scales it in optimizer step hooks
                group["lr"] = lr_at(step, cfg) * group.get("lr_ratio", 1.0)
            total = torch.zeros((), device=run.device)
            for _ in range(cfg.grad_accum):
                x, y = run.corpus.batch("train", cfg.batch_size, run.context, gen)  # (B, T) each
                x, y = x.to(run.device), y.to(run.device)
                with amp.autocast():
                    logits = model(x)  # (B, T, V)
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
                amp.backward(loss / cfg.grad_accum)
                total += loss.detach() / cfg.grad_accum
            amp.step(opt, model.parameters(), cfg.clip)
            if cb.after_update is not None:
                cb.after_update(total)
            for o in optimizers(opt):
                o.zero_grad(set_to_none=True)
            value = float(total)  # sync point: the loop reports the loss each step
            losses.append(value)
            if cb.on_step is not None:
                cb.on_step(step, value)
    finally:
        if cb.on_end is not None:
            cb.on_end()
    return TrainResult(losses)
