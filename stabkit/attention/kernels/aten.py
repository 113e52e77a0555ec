"""The ``aten`` scaled-dot-product-attention ops, for code that calls a backend directly
(``torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, …)``) instead of
``F.scaled_dot_product_attention`` (which is read as a torch function, not here). Read inside the
attention module's forward on sampled steps, like every kernel.

All take (B, H, L, E) query and (B, Hkv, S, E) key, an optional ``attn_mask`` / ``attn_bias`` (bool:
True = may attend; float: added) and ``scale``. ``is_causal`` is top-left aligned (query i sees keys
j <= i) as SDPA's, except in the CUDA flash op ``aten::_scaled_dot_product_flash_attention``: it runs
flash-attn 2's kernel, whose causal mask is aligned bottom-right when L != S (query i sees keys
j <= i + S - L). torch's ``sdp_utils.cpp`` says so (``check_flash_causal_non_square_seqlens``:
"FlashAttention 2 updated the default mask meaning for causal … it is now aligned to lower_right") and
therefore never dispatches a non-square causal SDPA call there; only a direct call reaches it. The CPU
flash op (``…_for_cpu``), the math, efficient (``CausalFromTopLeft``) and cuDNN ops are top-left.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..call import Positions, QKCall
from ..readers import sdpa_call
from .base import Kernel, add

OPS = (
    "aten::scaled_dot_product_attention",
    "aten::_scaled_dot_product_attention_math",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
)
FLASH_OPS = ("aten::_scaled_dot_product_flash_attention",)
"""The CUDA flash op: causal aligned bottom-right (flash-attn 2)."""


def read_aten(a: Mapping[str, Any]) -> QKCall:
    mask = a.get("attn_mask", a.get("attn_bias"))
    return sdpa_call(a["query"], a["key"], mask, bool(a.get("is_causal")), a.get("scale"))


def read_aten_flash(a: Mapping[str, Any]) -> QKCall:
    """The CUDA flash op (no mask argument): causal bottom-right when L != S."""
    call = sdpa_call(a["query"], a["key"], None, False, a.get("scale"))
    if a.get("is_causal"):
        n_q, n_k = call.q.shape[2], call.k.shape[2]
        if n_q == n_k:
            call.causal = True
        else:
            call.positions = Positions.aligned(n_q, n_k, call.q.device, bottom_right=True, causal=True)
    return call


ATEN = add(Kernel("aten_sdpa", "PyTorch aten SDPA ops", read_aten, ops=OPS, qk=("query", "key")))
ATEN_FLASH = add(
    Kernel(
        "aten_sdpa_flash", "PyTorch aten flash SDPA op", read_aten_flash, ops=FLASH_OPS, qk=("query", "key")
    )
)
