"""flash-attn 2 (≥ 2.7) and flash-attn 3: read at their Python entry points (``flash_attn_func``, the
packed ``qkvpacked`` / ``kvpacked`` variants, ``flash_attn_varlen_func`` and its packed variants;
Hugging Face's ``flash_attention_2`` / ``_3`` call these) and at their torch forward ops, which every
entry point goes through (a call made by other code, e.g. a ring-attention Function, is still read).

Interventions change a call at its entry point, where autograd sees it: each entry point hands its
arguments to an ``autograd.Function`` (``FlashAttnFunc``…) that saves the q and k *it* was given and
keeps its own ``softcap`` for the backward, so a cap or a q/k norm applied to the op inside would change
the forward only (`stabkit.attention.kernels.base.hides_its_backward`: such a call is refused).

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


PACKED_AXIS = -3
"""The axis of the (q, k, v) or (k, v) index in flash-attn's packed layouts: qkv (B, S, 3, H, D) or
(total, 3, H, D); kv (B, S, 2, Hk, D) or (total, 2, Hk, D)."""


def _heads_packed(a: Mapping[str, Any]) -> bool:
    """flash-attn 3's 4-d packed layout: qkv (B, S, Hq + 2·Hk, D) split by ``num_heads_q``."""
    qkv = a["qkv"]
    return qkv.dim() == 4 and bool(a.get("num_heads_q")) and qkv.shape[PACKED_AXIS] != 3


def _unpacked_qkv(a: Mapping[str, Any]) -> tuple[torch.Tensor, ...]:
    """q, k, v (views) of a packed ``qkv``: 3 along `PACKED_AXIS`, or split by heads (`_heads_packed`)."""
    qkv = a["qkv"]
    if _heads_packed(a):
        hq = int(a["num_heads_q"])
        hk = (qkv.shape[-2] - hq) // 2
        return tuple(qkv.split([hq, hk, hk], dim=-2))
    return tuple(qkv.unbind(dim=PACKED_AXIS))


def entry_arguments(a: Mapping[str, Any]) -> dict[str, Any]:
    """An entry point's bound arguments in the forward op's names: ``qkv`` / ``kv`` unpacked into q, k
    (views), ``window_size`` split into its two sides, one ``cu_seqlens`` for q and k. An op's own
    arguments pass unchanged."""
    out = dict(a)
    if "qkv" in out:
        out["q"], out["k"], _ = _unpacked_qkv(out)
    if "kv" in out:
        out["k"] = out["kv"].unbind(dim=PACKED_AXIS)[0]
    if "window_size" in out and "window_size_left" not in out:
        left, right = out["window_size"]
        out["window_size_left"], out["window_size_right"] = left, right
    if "cu_seqlens" in out:
        out["cu_seqlens_q"] = out["cu_seqlens_k"] = out["cu_seqlens"]
    for schema_name, name in (("is_causal", "causal"), ("q_v", "qv")):  # flash_attn_3::fwd's names
        if schema_name in out:
            out[name] = out[schema_name]
    return out


def descaled_queries(
    q: torch.Tensor, q_descale: Any, k_descale: Any, positions: Positions | None
) -> torch.Tensor:
    """(B, H, L, E) float32 queries times FA3's FP8 descale factors, so that q·k·scale is the logit the
    kernel computes: ``(q·k) · q_descale[b, g] · k_descale[b, g] · softmax_scale``, one factor per batch
    entry (document, when packed) and kv head g (``hopper/flash_api.cpp``: shapes (batch, num_heads_k);
    ``flash_fwd_kernel_sm90.h`` multiplies the scale by their product). A float32 copy of q, made on
    sampled steps only for FP8 calls."""
    given = [d.float() for d in (q_descale, k_descale) if d is not None]
    factor = given[0] if len(given) == 1 else given[0] * given[1]  # (batch, Hkv)
    per_head = factor.repeat_interleave(q.shape[1] // factor.shape[1], dim=1)  # (batch, H)
    if positions is not None and positions.q_doc is not None:  # packed: one row per document
        per_query = per_head[positions.q_doc.clamp(min=0)]  # (T, H)
        return q.float() * per_query.t().reshape(1, q.shape[1], -1, 1)
    return q.float() * per_head.reshape(per_head.shape[0], q.shape[1], 1, 1)


def map_packed_qk(a: dict[str, Any], f: Any, g: Any) -> None:
    """Replace q by f(q) and k by g(k) in an entry point's arguments, repacking ``qkv`` / ``kv``
    (autograd sees the stack, so the gradients reach the packed input)."""
    if "qkv" in a:
        q, k, v = _unpacked_qkv(a)
        if _heads_packed(a):
            a["qkv"] = torch.cat([f(q), g(k), v], dim=-2)
        else:
            a["qkv"] = torch.stack([f(q), g(k), v], dim=PACKED_AXIS)
        return
    a["q"] = f(a["q"])
    if "kv" in a:
        k, v = a["kv"].unbind(dim=PACKED_AXIS)
        a["kv"] = torch.stack([g(k), v], dim=PACKED_AXIS)
    else:
        a["k"] = g(a["k"])


def read_flash2(a: Mapping[str, Any]) -> QKCall:
    """``flash_attn::_flash_attn_forward``, ``flash_attn::_flash_attn_varlen_forward`` and the Python
    entry points (`entry_arguments`)."""
    a = entry_arguments(a)
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
    """``flash_attn_3::_flash_attn_forward``, the C++ op ``flash_attn_3::fwd`` under it (its schema says
    ``is_causal``, ``q_v``; FA3 builds from May to July 2025 call it straight from Python), dense or
    packed with ``cu_seqlens_q/k``, and the Python entry points (`entry_arguments`). FP8 calls: the
    logits include ``q_descale`` · ``k_descale`` (`descaled_queries`)."""
    a = entry_arguments(a)
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
    if a.get("q_descale") is not None or a.get("k_descale") is not None:
        q = descaled_queries(q, a.get("q_descale"), a.get("k_descale"), positions)
    return QKCall(q, k, a.get("softmax_scale"), positions=positions, softcap=positive(a.get("softcap")))


def cap_argument(a: dict[str, Any], cap: float) -> None:
    """Soft-cap through flash-attn's own ``softcap`` argument (flash-attn ≥ 2.6, flash-attn 3)."""
    if positive(a.get("softcap")) is not None:
        raise ValueError(f"the call soft-caps already (softcap={a['softcap']})")
    if float(a.get("dropout_p") or 0.0) > 0:
        raise ValueError(
            f"flash-attn cannot soft-cap with attention dropout (dropout_p={a['dropout_p']}: "
            "'Softcapping does not support dropout'); set the attention dropout to 0"
        )
    a["softcap"] = float(cap)


FLASH2_ENTRY_POINTS = tuple(
    f"flash_attn.flash_attn_interface:{name}"
    for name in (
        "flash_attn_func",
        "flash_attn_kvpacked_func",
        "flash_attn_qkvpacked_func",
        "flash_attn_varlen_func",
        "flash_attn_varlen_kvpacked_func",
        "flash_attn_varlen_qkvpacked_func",
    )
)
"""flash-attn 2.8's training entry points (``flash_attn/flash_attn_interface.py``); ``flash_attn`` re-exports
them and Hugging Face imports them (every copy is wrapped, `entry_points`)."""
FLASH3_ENTRY_POINTS = tuple(
    f"{module}:{name}"
    for module in ("flash_attn_interface", "flash_attn_3.flash_attn_interface")
    for name in ("flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func")
)
"""flash-attn 3's training entry points (``hopper/flash_attn_interface.py``, installed as the top-level
``flash_attn_interface`` module, and in newer builds also under ``flash_attn_3``)."""


FLASH2 = add(
    Kernel(
        "flash_attn",
        "flash-attn 2",
        read_flash2,
        ops=("flash_attn::_flash_attn_forward", "flash_attn::_flash_attn_varlen_forward"),
        functions=FLASH2_ENTRY_POINTS,
        cap=cap_argument,
        map_qk=map_packed_qk,
    )
)
FLASH3 = add(
    Kernel(
        "flash_attn_3",
        "flash-attn 3",
        read_flash3,
        ops=("flash_attn_3::_flash_attn_forward", "flash_attn_3::fwd"),
        functions=FLASH3_ENTRY_POINTS,
        cap=cap_argument,
        map_qk=map_packed_qk,
    )
)
