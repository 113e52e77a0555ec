"""flash-attn 2 (≥ 2.7) and flash-attn 3: read at their torch ops, which every Python entry point
(``flash_attn_func``, the packed ``qkvpacked`` / ``kvpacked`` variants, ``flash_attn_varlen_func``,
Hugging Face's ``flash_attention_2``) goes through.

Semantics (flash-attn's docstrings): q, k, v are (batch, seqlen, heads, head_dim), or packed
(total, heads, head_dim) with ``cu_seqlens_q/k`` for the varlen ops; query head h uses key head
h // (H / Hkv); ``causal`` is aligned to the bottom-right corner when seqlen_q != seqlen_k (query i
sits at key position i + S - L; per document when packed); ``window_size_left/right`` (-1: unbounded)
limit the keys around that position; ``softcap`` > 0 caps the scores before masking; ``alibi_slopes``
(H,) or (B, H) add ``-slope · |i + S - L - j|``; flash-attn 3's ``attention_chunk`` keeps a query to
the keys of its own chunk. Paged KV caches, ``seqused_k`` / ``leftpad_k`` and FA3's ``qv`` /
``k_new`` are inference features: a call using them is refused by the reader (ValueError), which the
probe reports once for that attention module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..call import Positions, QKCall
from .base import Kernel, add


def window(left: Any, right: Any) -> tuple[int, int] | None:
    """(left, right) with -1 = unbounded; None when both sides are unbounded."""
    left = -1 if left is None else int(left)
    right = -1 if right is None else int(right)
    return None if left < 0 and right < 0 else (left, right)


def positive(value: Any) -> float | None:
    """A soft cap or chunk given as 0 / None when unused."""
    return float(value) if value is not None and float(value) > 0 else None


def _refuse(a: Mapping[str, Any], names: tuple[str, ...], kernel: str) -> None:
    used = [n for n in names if a.get(n) is not None and a.get(n) is not False]
    if used:
        raise ValueError(f"{kernel} call with {', '.join(used)} (an inference feature): not measured")


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """(B, T, H, D) -> (B, H, T, D); packed (T, H, D) -> (1, H, T, D). Views."""
    return x.transpose(1, 2) if x.dim() == 4 else x.transpose(0, 1).unsqueeze(0)


def _positions(
    q: torch.Tensor,
    k: torch.Tensor,
    cu_q: torch.Tensor | None,
    cu_k: torch.Tensor | None,
    **masks: Any,
) -> Positions | None:
    n_q, n_k = q.shape[2], k.shape[2]
    if cu_q is not None and cu_k is not None:
        return Positions.packed(cu_q, cu_k, n_q, n_k, bottom_right=True, **masks)
    if not (
        masks.get("causal") or masks.get("window") or masks.get("chunk") or masks.get("alibi") is not None
    ):
        return None
    return Positions.aligned(n_q, n_k, q.device, bottom_right=True, **masks)


def read_flash2(a: Mapping[str, Any]) -> QKCall:
    """``flash_attn::_flash_attn_forward`` and ``flash_attn::_flash_attn_varlen_forward``."""
    _refuse(a, ("block_table", "leftpad_k", "seqused_k"), "flash_attn")
    q, k = _heads_first(a["q"]), _heads_first(a["k"])
    positions = _positions(
        q,
        k,
        a.get("cu_seqlens_q"),
        a.get("cu_seqlens_k"),
        causal=bool(a["causal"]),
        window=window(a.get("window_size_left"), a.get("window_size_right")),
        alibi=a.get("alibi_slopes"),
    )
    return QKCall(q, k, a.get("softmax_scale"), positions=positions, softcap=positive(a.get("softcap")))


def read_flash3(a: Mapping[str, Any]) -> QKCall:
    """``flash_attn_3::_flash_attn_forward`` (dense, or packed with ``cu_seqlens_q/k``)."""
    _refuse(
        a,
        (
            "k_new",
            "v_new",
            "qv",
            "page_table",
            "kv_batch_idx",
            "leftpad_k",
            "rotary_cos",
            "seqused_q",
            "seqused_k",
        ),
        "flash_attn_3",
    )
    if (a.get("cu_seqlens_q") is None) != (a.get("cu_seqlens_k") is None):
        raise ValueError("flash_attn_3 call with cu_seqlens for only one of q and k: not measured")
    q, k = _heads_first(a["q"]), _heads_first(a["k"])
    chunk = a.get("attention_chunk")
    positions = _positions(
        q,
        k,
        a.get("cu_seqlens_q"),
        a.get("cu_seqlens_k"),
        causal=bool(a.get("causal")),
        window=window(a.get("window_size_left"), a.get("window_size_right")),
        chunk=int(chunk) if chunk else 0,
    )
    return QKCall(q, k, a.get("softmax_scale"), positions=positions, softcap=positive(a.get("softcap")))


def cap_argument(a: dict[str, Any], cap: float) -> None:
    """Soft-cap through flash-attn's own ``softcap`` argument (flash-attn ≥ 2.6, flash-attn 3)."""
    if positive(a.get("softcap")) is not None:
        raise ValueError(f"the call soft-caps already (softcap={a['softcap']})")
    a["softcap"] = float(cap)


FLASH2 = add(
    Kernel(
        "flash_attn",
        "flash-attn 2",
        read_flash2,
        ops=("flash_attn::_flash_attn_forward", "flash_attn::_flash_attn_varlen_forward"),
        cap=cap_argument,
    )
)
FLASH3 = add(
    Kernel(
        "flash_attn_3",
        "flash-attn 3",
        read_flash3,
        ops=("flash_attn_3::_flash_attn_forward",),
        cap=cap_argument,
    )
)
