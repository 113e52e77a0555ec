"""STAND-IN for ``transformer_engine.pytorch.attention.dot_product_attention.backends`` (tests only).

Follows NVIDIA/TransformerEngine @ d0067d0d (2.20.0.dev0) ``.../dot_product_attention/backends.py``, whose
three backend modules are where ``DotProductAttention`` keeps its scale (it has no ``softmax_scale`` of
its own; the same in TE 2.2–2.9): ``FlashAttention``, ``FusedAttention`` and
``UnfusedDotProductAttention`` each take ``softmax_scale`` first and keep it as ``self.softmax_scale``.
Only the constructors are mirrored (same parameter names and defaults); the stand-in's
``DotProductAttention`` computes with its shared math and reads the scale from ``unfused_attention``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

__standin__ = True


class UnfusedDotProductAttention(torch.nn.Module):
    def __init__(
        self,
        softmax_scale: float,
        attention_type: str = "self",
        attention_dropout: float = 0.0,
        attention_dropout_ctx: Callable | None = nullcontext,
        layer_number: int | None = None,
        softmax_type: str = "vanilla",
        return_max_logit: bool | None = False,
    ) -> None:
        super().__init__()
        self.softmax_scale = softmax_scale
        self.attention_type = attention_type
        self.attention_dropout_ctx = attention_dropout_ctx
        self.layer_number = layer_number
        self.softmax_type = softmax_type
        self.return_max_logit = return_max_logit


class FlashAttention(torch.nn.Module):
    def __init__(
        self,
        softmax_scale: float,
        attention_dropout: float = 0.0,
        attention_dropout_ctx: Callable | None = nullcontext,
        attention_type: str = "self",
        layer_number: int | None = None,
        deterministic: bool = False,
    ) -> None:
        super().__init__()
        self.softmax_scale = softmax_scale
        self.attention_dropout = attention_dropout
        self.attention_dropout_ctx = attention_dropout_ctx
        self.attention_type = attention_type
        self.layer_number = layer_number
        self.deterministic = deterministic


class FusedAttention(torch.nn.Module):
    def __init__(
        self,
        softmax_scale: float,
        attention_dropout: float = 0.0,
        attention_dropout_ctx: Callable | None = nullcontext,
        attention_type: str = "self",
        layer_number: int | None = None,
        deterministic: bool = False,
        softmax_type: str = "vanilla",
        return_max_logit: bool | None = False,
    ) -> None:
        super().__init__()
        self.softmax_scale = softmax_scale
        self.attention_dropout = attention_dropout
        self.attention_dropout_ctx = attention_dropout_ctx
        self.attention_type = attention_type
        self.layer_number = 1 if layer_number is None else layer_number
        self.deterministic = deterministic
        self.softmax_type = softmax_type
        self.return_max_logit = return_max_logit
