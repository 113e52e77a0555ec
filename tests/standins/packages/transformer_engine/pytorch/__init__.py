"""STAND-IN for ``transformer_engine.pytorch``: only ``DotProductAttention`` (see its module docstring)."""

from transformer_engine.pytorch.attention import DotProductAttention

__standin__ = True

__all__ = ["DotProductAttention"]
