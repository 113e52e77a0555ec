"""Transformer Engine ``DotProductAttention``: a module; its ``forward`` is the entry point, made
visible by `entry_points` (the class attribute is wrapped), read from its arguments and the module's
own settings (``qkv_format``, ``attn_mask_type``, ``window_size``, ``softmax_scale``,
``num_gqa_groups``, ``softmax_type``).

Semantics (TE's ``DotProductAttention`` docs): formats "sbhd", "bshd" and packed "thd" (with
``cu_seqlens_q`` / ``cu_seqlens_kv``); mask types ``no_mask``, ``causal`` / ``padding_causal``
(top-left), ``causal_bottom_right`` / ``padding_causal_bottom_right``, ``padding``, ``arbitrary``
(``attention_mask`` bool, True = masked out); padding from ``attention_mask`` (True = padded token;
a (q, kv) pair for cross attention); ``window_size`` (left, right), a causal type forcing right = 0;
biases ``post_scale_bias`` (added to q·kᵀ·scale), ``pre_scale_bias`` (added before the scale),
``alibi`` (``alibi_slopes``, or TE's default slopes); ``softmax_type`` "off-by-one" (a zero sink
logit per head) and "learnable" (``softmax_offset``). Packed inputs (``qkv_layer``/``kv_layer``) and
padded cumulative lengths are refused by the reader (not measured).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..call import Positions, QKCall
from .base import Kernel, add


def _mask_type(value: str) -> str:
    value = value.replace(",", "_")
    return "padding_causal" if value in ("causal_padding",) else value


def _window(mask_type: str, window: Any) -> tuple[int, int] | None:
    """TE's ``check_set_window_size``: causal types force the right side to 0."""
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    if "causal" in mask_type:
        right = 0
    return None if left < 0 and right < 0 else (left, right)


def alibi_slopes(heads: int, device: torch.device) -> torch.Tensor:
    """The standard ALiBi slopes (Press et al.), TE's default."""

    def powers(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(heads).is_integer():
        slopes = powers(heads)
    else:
        closest = 2 ** math.floor(math.log2(heads))
        slopes = powers(closest) + powers(2 * closest)[0::2][: heads - closest]
    return torch.tensor(slopes, device=device)


def _heads_first(x: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt == "sbhd":
        return x.permute(1, 2, 0, 3)
    if fmt == "bshd":
        return x.transpose(1, 2)
    return x.transpose(0, 1).unsqueeze(0)  # thd


def read_te(a: Mapping[str, Any]) -> QKCall:
    mod = a["self"]
    for name in ("qkv_layer", "kv_layer", "cu_seqlens_q_padded", "cu_seqlens_kv_padded", "inference_params"):
        if a.get(name) is not None:
            raise ValueError(f"DotProductAttention with {name}: not measured")
    fmt = a.get("qkv_format") or mod.qkv_format
    mask_type = _mask_type(a.get("attn_mask_type") or mod.attn_mask_type)
    q, k = _heads_first(a["query_layer"], fmt), _heads_first(a["key_layer"], fmt)
    n_q, n_k = q.shape[2], k.shape[2]
    bottom = a.get("bottom_right_diagonal")
    bottom = getattr(mod, "bottom_right_diagonal", None) if bottom is None else bottom
    if mask_type in ("causal", "padding_causal"):
        bottom = False
    elif bottom is None or mask_type.endswith("bottom_right"):
        bottom = True
    masks: dict[str, Any] = {
        "causal": "causal" in mask_type,
        "window": _window(mask_type, a.get("window_size") or getattr(mod, "window_size", None)),
    }
    bias_type = a.get("core_attention_bias_type") or "no_bias"
    if bias_type == "alibi":
        slopes = a.get("alibi_slopes")
        masks["alibi"] = slopes if slopes is not None else alibi_slopes(q.shape[1], q.device)
    call = QKCall(q, k, mod.softmax_scale)
    if fmt == "thd":
        call.positions = Positions.packed(
            a["cu_seqlens_q"], a["cu_seqlens_kv"], n_q, n_k, bottom_right=bottom, **masks
        )
    elif masks["causal"] or masks["window"] or "alibi" in masks:
        call.positions = Positions.aligned(n_q, n_k, q.device, bottom_right=bool(bottom), **masks)
    mask = a.get("attention_mask")
    if mask is not None and fmt != "thd":
        if mask_type == "arbitrary":
            call.allowed = ~mask.bool()
        elif "padding" in mask_type:
            q_pad, kv_pad = mask if isinstance(mask, tuple | list) else (mask, mask)
            rows = ~q_pad.bool().reshape(q.shape[0], 1, n_q, 1)  # padded queries: no row
            call.allowed = rows & ~kv_pad.bool().reshape(k.shape[0], 1, 1, n_k)
    bias = a.get("core_attention_bias")
    if bias is not None and bias_type in ("post_scale_bias", "pre_scale_bias"):
        scale = mod.softmax_scale if mod.softmax_scale is not None else q.shape[-1] ** -0.5
        call.bias = bias if bias_type == "post_scale_bias" else bias * scale
    softmax_type = getattr(mod, "softmax_type", "vanilla")
    if softmax_type == "off-by-one":
        call.sinks = torch.zeros(q.shape[1], device=q.device)
    elif softmax_type == "learnable":
        call.sinks = mod.softmax_offset
    return call


TE = add(
    Kernel(
        "transformer_engine",
        "Transformer Engine",
        read_te,
        functions=(
            "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention:DotProductAttention.forward",
        ),
        qk=("query_layer", "key_layer"),
    )
)
