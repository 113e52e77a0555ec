"""STAND-IN for ``transformer_engine.pytorch.attention`` (DotProductAttention only)."""

from .dot_product_attention import DotProductAttention

__all__ = ["DotProductAttention"]
