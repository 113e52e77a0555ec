"""`TrainConfig`: the optimiser, schedule, length and precision of one training run.

Plain data (imports no torch): filled from a recipe's ``[train]`` table (`stabkit.tables.fill` checks
the ranges in the fields' metadata) and read by the loop (`stabkit.harness.training.loop`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from ...tables import bounds

Precision = Literal["fp32", "bf16", "fp16"]
OptimizerKind = Literal["adamw", "muon"]
MuonAdjust = Literal["original", "match_rms_adamw"]

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
    optimizer: OptimizerKind = "adamw"
    """``adamw`` for every parameter; ``muon``: `torch.optim.Muon` on the blocks' 2-D weights (the hidden
    matrices) and AdamW on embeddings, norms, biases and the output head, as Muon users do."""
    muon_lr: float | None = field(default=None, metadata=bounds(lo=0.0, lo_open=True, hint="or none"))
    """With ``optimizer = "muon"``: Muon's peak learning rate (on the same warmup and cosine); None:
    `lr`. `lr` stays AdamW's, for the other parameters."""
    muon_momentum: float = field(default=0.95, metadata=bounds(lo=0.0, hi=1.0, hi_open=True))
    """Muon's momentum (Nesterov)."""
    muon_adjust_lr: MuonAdjust = "original"
    """Muon's per-matrix learning-rate scaling: ``original`` (Keller Jordan: √max(1, rows/cols)) or
    ``match_rms_adamw`` (Moonshot: 0.2·√max(rows, cols), so AdamW's learning rate carries over)."""
    precision: Precision = "fp32"
    """fp32, or bf16 / fp16 autocast around the forward pass and the loss (`train` and `evaluate` set
    it up, `stabkit.harness.training.precision.Amp`; fp16 adds a GradScaler where one is used)."""
    grad_scaler: bool | None = None
    """fp16's loss scaler (a GradScaler on the backward pass and the step): None (``"none"`` in a recipe)
    = on off the CPU, off on a CPU, as the recipes were first measured; True / False: on / off
    wherever it runs. Without one, fp16 gradients underflow, and Adam's normalised steps on what is
    left grow the weights (measured on low-precision: the MLP's output 5× its fp32 value after 150
    steps, until it overflowed fp16 too)."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("TrainConfig.steps, batch_size and grad_accum must be >= 1")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"TrainConfig.lr must be a positive number, got {self.lr!r}")
        if self.warmup < 0 or self.weight_decay < 0 or self.eps <= 0:
            raise ValueError("TrainConfig.warmup and weight_decay must be >= 0 and eps > 0")
        if self.clip is not None and self.clip <= 0:
            raise ValueError(f"TrainConfig.clip must be None or > 0, got {self.clip!r}")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"TrainConfig.optimizer must be adamw or muon, got {self.optimizer!r}")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"TrainConfig.precision must be fp32, bf16 or fp16, got {self.precision!r}")
