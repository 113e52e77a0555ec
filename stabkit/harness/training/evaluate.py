"""Held-out evaluation of a model as it is now: the loss, log Z and mean output logit on fixed
validation batches, in the run's precision.

Runs whenever the caller asks — before training, every ``train.eval_every`` steps, at the end, after
stabkit stopped a run — without gradients, in eval mode, on batches of its own seed: training is
unchanged by it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .loop import Corpus
from .precision import Amp

EVAL_SEED = 1234
"""Seed of the held-out batches: every variant and every evaluation sees the same ones."""


@dataclass(frozen=True)
class Heldout:
    """Means over the held-out batches (host floats)."""

    val_loss: float
    """Cross-entropy (nats per byte)."""
    mean_logz: float
    """log Z, the logsumexp of the output logits."""
    mean_abs_logz: float
    """|log Z|."""
    mean_logit: float
    """The output logit, over the vocabulary and the positions."""

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Heldout:
        return cls(**{k: data[k] for k in ("val_loss", "mean_logz", "mean_abs_logz", "mean_logit")})


@torch.no_grad()
def evaluate(
    model: nn.Module,
    corpus: Corpus,
    *,
    batches: int,
    batch_size: int,
    context: int,
    device: torch.device | str = "cpu",
    amp: Amp | None = None,
) -> Heldout:
    """`Heldout` over `batches` validation batches drawn with `EVAL_SEED`, each forward under
    `amp`'s autocast (none: fp32)."""
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(EVAL_SEED)
    cast = amp or Amp("fp32", torch.device(device).type)
    loss = logz = abs_logz = mean_logit = 0.0
    try:
        for _ in range(batches):
            x, y = corpus.batch("val", batch_size, context, gen)  # (B, T) each
            with cast.autocast():
                logits = model(x.to(device)).float()  # (B, T, V)
            lse = torch.logsumexp(logits, dim=-1)  # (B, T)
            loss += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(device).reshape(-1)))
            logz += float(lse.mean())
            abs_logz += float(lse.abs().mean())
            mean_logit += float(logits.mean())
    finally:
        model.train(was_training)
    return Heldout(loss / batches, logz / batches, abs_logz / batches, mean_logit / batches)
