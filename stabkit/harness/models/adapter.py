"""`TokensToLogits`: the recipes' training loop calls ``model(tokens)`` and reads logits (B, T, V); a
Hugging Face causal LM returns an output object, a user's model may return a tuple. Wrapped once, when a
non-reference model is built (`stabkit.harness.models.build`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class TokensToLogits(nn.Module):
    """``model(tokens) -> logits``: calls the wrapped model and takes its logits (the ``logits`` field
    of an output object, the first element of a tuple, or the tensor itself). The wrapped model is the
    submodule ``model``, so its modules are named ``model.<its own names>``."""

    def __init__(self, model: nn.Module, hf: bool = False) -> None:
        super().__init__()
        self.model = model
        self.hf = hf

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=tokens, use_cache=False) if self.hf else self.model(tokens)
        return logits_of(out)


def logits_of(out: Any) -> torch.Tensor:
    """The logits in a model's output; a TypeError naming what came back otherwise."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(
        f"the model returned {type(out).__name__}; a recipe needs logits (batch, seq, vocab): a tensor, "
        "an object with .logits, or a tuple whose first element is them"
    )
