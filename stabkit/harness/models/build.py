"""Build the model a `ModelSpec` names at a recipe's size: the one place every command builds from.

Runs once per variant (workers), per `stabkit inspect` / `bench` call. The reference GPT is returned as
is; any other model is wrapped in `TokensToLogits`, so the training loop's ``model(tokens)`` gives logits.
"""

from __future__ import annotations

from torch import nn

from .adapter import TokensToLogits
from .config import GPTConfig
from .spec import ModelSpec


def build(spec: ModelSpec | None, size: GPTConfig) -> nn.Module:
    """The model of `spec` (None: the reference GPT) shaped by `size`, initialised from the current torch
    seed on the current default device. Raises ModelSpecError for a spec that cannot be built."""
    if spec is None or spec.is_reference:
        from .gpt import GPT

        return GPT(size)
    if spec.kind == "hf":
        from .hf_build import build_hf

        return TokensToLogits(build_hf(spec.target, size, spec.options), hf=True)
    from .factory import build_callable

    return TokensToLogits(build_callable(spec.target, size, spec.options))
