"""The `ZooModel` record every zoo builder returns, and small helpers the builders share."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 2
SEQ = 12
VOCAB = 96


@dataclass(kw_only=True)
class ZooModel:
    """A tiny model ready for one training step: ``loss_fn(model(*args, **inputs)).backward()``."""

    model: nn.Module
    """Tiny, float32, CPU, dropout 0, in train() mode."""
    inputs: dict[str, Any]
    """Keyword inputs of the forward."""
    args: tuple = ()
    """Positional inputs of the forward."""
    loss_fn: Callable[[Any], torch.Tensor]
    """Model output -> differentiable scalar loss (cross entropy against targets made by the builder)."""
    logits_fn: Callable[[Any], torch.Tensor] | None
    """Model output -> its final logits tensor (None for a model without logits, e.g. a bare encoder)."""
    n_attention_calls: int
    """Attention calls (self + cross) in one forward, counted from the architecture."""
    notes: str = ""
    """What is special about this model's attention / residual layout."""
    n_classes: int | None = None
    """Size of the logits' last dim (vocabulary or classes); None when `logits_fn` is None."""

    def forward(self) -> Any:
        """One forward with the builder's inputs."""
        return self.model(*self.args, **self.inputs)


def require(module: str, install: str | None = None) -> ModuleType:
    """Import `module`, or raise an ImportError that says what the zoo entry needs and how to get it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        install = install or f"pip install -c constraints-zoo.txt {module.replace('_', '-')}"
        raise ImportError(f"zoo entry needs {module!r} ({install}): {exc}") from exc


def tokens(vocab: int = VOCAB, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    """(batch, seq) random token ids in [0, vocab) (draws from the global generator: seed first)."""
    return torch.randint(0, vocab, (batch, seq))


def token_ce(targets: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """Cross entropy of (..., V) logits against integer `targets` of shape (...)."""

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    return loss


def finish(model: nn.Module) -> nn.Module:
    """float32, CPU, train mode; checks that no dropout or stochastic-depth module is left switched on."""
    model = model.float().train()
    for name, module in model.named_modules():
        where = name or type(module).__name__
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p:
            raise AssertionError(f"zoo model keeps dropout p={module.p} at {where}")
        drop_prob = getattr(module, "drop_prob", None)  # timm DropPath, Hugging Face *DropPath
        if isinstance(drop_prob, float) and drop_prob > 0:
            raise AssertionError(f"zoo model keeps stochastic depth drop_prob={drop_prob} at {where}")
    return model
