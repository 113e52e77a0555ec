"""The ``aten`` scaled-dot-product-attention ops, for code that calls a backend directly
(``torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, …)``) instead of
``F.scaled_dot_product_attention`` (which is read as a torch function, not here).

All take (B, H, L, E) query and (B, Hkv, S, E) key, ``is_causal`` top-left aligned as SDPA, an
optional ``attn_mask`` / ``attn_bias`` (bool: True = may attend; float: added) and ``scale``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..call import QKCall
from ..readers import sdpa_call
from .base import Kernel, add

OPS = (
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_attention_math",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
)


def read_aten(a: Mapping[str, Any]) -> QKCall:
    mask = a.get("attn_mask", a.get("attn_bias"))
    return sdpa_call(a["query"], a["key"], mask, bool(a.get("is_causal")), a.get("scale"))


ATEN = add(Kernel("aten_sdpa", "PyTorch aten SDPA ops", read_aten, ops=OPS, qk=("query", "key")))
