"""What an attention call site's module says about its call: the soft cap it applies itself (or an
intervention set on it), whether a softmax is attention-shaped, autocast off for the statistics.

Read by the attention probe and QK-Clip inside the attention module's forward (sampled steps)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

INTERVENTION_CAP_ATTR = "_stabkit_attn_softcap"
"""Attribute the attn_softcap intervention sets on a capped attention module (its cap)."""
_MODEL_CAP_ATTRS = ("softcap", "attn_logit_softcapping")


def positive_number(value: Any) -> float | None:
    """`value` as a float when it is a positive number (not a bool), else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None


def model_cap(module: nn.Module) -> float | None:
    """The soft cap a module applies itself before its softmax (reference GPT, HF Gemma-style), if any."""
    for obj in (module, getattr(module, "config", None)):
        for attr in _MODEL_CAP_ATTRS:
            cap = positive_number(getattr(obj, attr, None))
            if cap is not None:
                return cap
    return None


def attention_shaped(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """True for a softmax over the last dim of a 4-d float tensor — attention weights; a router's or
    a head's softmax inside an inline-attention block is left alone."""
    x = args[0] if args else kwargs.get("input")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    return isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point() and dim in (-1, 3)


def no_autocast(args: tuple[Any, ...], kwargs: dict[str, Any]) -> AbstractContextManager[Any]:
    """Autocast off on the device of the call's first tensor (statistics stay in float32); nothing
    to turn off (a `nullcontext`, no autocast object made: ~3 µs) when it is not on there."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            device = value.device.type
            if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
                return torch.autocast(device, enabled=False)
            break
    return nullcontext()
