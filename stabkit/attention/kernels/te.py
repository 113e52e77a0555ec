"""Transformer Engine ``DotProductAttention``: a module; its ``forward`` is the entry point, made
visible by `entry_points` (the class attribute is wrapped), read from its arguments and the module's
own settings. Read inside the attention module's forward, on sampled steps (and by discovery's trace).

Read against NVIDIA/TransformerEngine 2.2–2.9 and main (2.20.0.dev0,
``transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py``; TE ≤ 2.2 keeps
the class in ``transformer_engine/pytorch/attention.py``, the second import path below):

- the scale: ``DotProductAttention`` keeps no ``softmax_scale`` of its own; it hands the scale (default
  1/sqrt(kv_channels)) to its backends ``flash_attention`` / ``fused_attention`` / ``unfused_attention``,
  which keep it as ``softmax_scale`` (`softmax_scale`);
- inputs: ``query_layer`` / ``key_layer``, or (main, 2.20) the packed ``qkv_layer`` with
  ``query_layer=None`` — what ``MultiheadAttention`` and ``TransformerLayer`` pass for self-attention
  when query and kv heads are as many — or ``query_layer`` with a packed ``kv_layer``; q, k (and v)
  are ``select(qkv_interleave_dim, i)`` of the packed tensor (TE's ``_unpack_packed_qkv``);
- formats "sbhd", "bshd" and packed "thd" (``cu_seqlens_q`` / ``cu_seqlens_kv``, with
  ``cu_seqlens_*_padded`` where sequences start when there are gaps);
- mask types ``no_mask``, ``causal`` / ``padding_causal`` (top-left), ``causal_bottom_right`` /
  ``padding_causal_bottom_right``, ``padding``, ``arbitrary`` (``attention_mask`` bool, True = masked
  out); the alignment ``bottom_right_diagonal`` is forced False for causal / padding_causal, True for
  the *_bottom_right types and defaults to True otherwise;
- ``window_size`` (left, right) as TE's ``check_set_window_size`` makes it (`te_window`): causal types
  get right = 0, non-causal types turn (-1, 0) into (-1, -1) — a module built causal and called with
  ``attn_mask_type="padding"`` attends both ways;
- padding with sbhd / bshd (padding types): ``attention_mask`` (bool, True = padded token; a
  (q, kv) pair for cross attention) or, without one, ``cu_seqlens_q`` / ``cu_seqlens_kv`` (each row's
  tokens beyond its length are padding); padded queries have no row, padded keys are seen by no query,
  and bottom-right alignment uses each row's actual lengths (offset = kv length − q length);
- biases ``post_scale_bias`` (added to q·kᵀ·scale), ``pre_scale_bias`` (added before the scale),
  ``alibi`` (``alibi_slopes``, or TE's default slopes); ``softmax_type`` "off-by-one" (a zero sink
  logit per head) and "learnable" (``softmax_offset``).

KV caches (``inference_params``) and cuDNN's ``score_mod`` are refused by the reader (not measured).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from ..call import Positions, QKCall
from .base import Kernel, QKMap, add
from .flash import window as flash_window

BACKENDS = ("flash_attention", "fused_attention", "unfused_attention")
"""The submodules a ``DotProductAttention`` hands its ``softmax_scale`` to."""
PACKED_DIM = -3
"""``qkv_interleave_dim``'s default: the (q, k, v) index sits before the heads ((s, b, 3, h, d))."""


def softmax_scale(mod: Any) -> float | None:
    """The logit scale of a ``DotProductAttention``: its backends' ``softmax_scale`` (None: 1/sqrt(E))."""
    for name in BACKENDS:
        scale = getattr(getattr(mod, name, None), "softmax_scale", None)
        if scale is not None:
            return float(scale)
    scale = getattr(mod, "softmax_scale", None)  # a subclass or wrapper that keeps it itself
    return float(scale) if scale is not None else None


def _mask_type(value: str) -> str:
    value = value.replace(",", "_")
    return "padding_causal" if value in ("causal_padding",) else value


def te_window(mask_type: str, window: Any) -> tuple[int, int]:
    """TE's ``check_set_window_size``: the (left, right) window a call with `mask_type` runs with."""
    if window is None:
        return (-1, 0) if "causal" in mask_type else (-1, -1)
    left, right = int(window[0]), int(window[1])
    if "causal" in mask_type:
        if (left, right) == (-1, -1) or (left >= 0 and right != 0):
            return (left, 0)
        if (left, right) != (-1, 0) and (left < 0 or right != 0):
            raise ValueError(f"window_size {(left, right)} with attn_mask_type={mask_type!r}: TE refuses it")
        return (left, right)
    if mask_type in ("no_mask", "padding", "arbitrary"):
        if (left, right) == (-1, 0):
            return (-1, -1)
        if (left, right) != (-1, -1) and (left < 0 or right < 0):
            raise ValueError(f"window_size {(left, right)} with attn_mask_type={mask_type!r}: TE refuses it")
        return (left, right)
    raise ValueError(f"Transformer Engine attn_mask_type {mask_type!r}: not measured")


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


def _interleave_dim(a: Mapping[str, Any]) -> int:
    dim = a.get("qkv_interleave_dim")
    return PACKED_DIM if dim is None else int(dim)


def te_arguments(a: Mapping[str, Any]) -> dict[str, Any]:
    """The bound arguments with ``query_layer`` / ``key_layer`` / ``value_layer`` filled in from a
    packed ``qkv_layer`` or ``kv_layer`` (views: ``select`` along ``qkv_interleave_dim``)."""
    out = dict(a)
    dim = _interleave_dim(a)
    if a.get("qkv_layer") is not None:
        qkv = a["qkv_layer"]
        out["query_layer"], out["key_layer"], out["value_layer"] = (qkv.select(dim, i) for i in range(3))
    elif a.get("kv_layer") is not None:
        out["key_layer"], out["value_layer"] = (a["kv_layer"].select(dim, i) for i in range(2))
    return out


def map_te_qk(a: dict[str, Any], f: QKMap, g: QKMap) -> None:
    """Replace q by f(q) and k by g(k) in a call's bound arguments, repacking a packed ``qkv_layer`` /
    ``kv_layer`` along its interleave dim (autograd sees the stack: gradients reach the packed input)."""
    dim = _interleave_dim(a)
    if a.get("qkv_layer") is not None:
        q, k, v = (a["qkv_layer"].select(dim, i) for i in range(3))
        a["qkv_layer"] = torch.stack([f(q), g(k), v], dim=dim)
        return
    a["query_layer"] = f(a["query_layer"])
    if a.get("kv_layer") is not None:
        k, v = (a["kv_layer"].select(dim, i) for i in range(2))
        a["kv_layer"] = torch.stack([g(k), v], dim=dim)
    else:
        a["key_layer"] = g(a["key_layer"])


def _padding(
    a: Mapping[str, Any], b: int, n_q: int, n_k: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) and (B, S) bool, True = padded token, of an sbhd / bshd call with a padding mask type."""
    mask = a.get("attention_mask")
    if mask is not None:
        q_pad, kv_pad = mask if isinstance(mask, tuple | list) else (mask, mask)
        return q_pad.bool().reshape(b, n_q), kv_pad.bool().reshape(b, n_k)
    cu_q, cu_k = a.get("cu_seqlens_q"), a.get("cu_seqlens_kv")
    if cu_q is None or cu_k is None:
        raise ValueError(
            "DotProductAttention with a padding mask type and neither attention_mask nor cu_seqlens"
        )
    q_pad = torch.arange(n_q, device=device) >= cu_q.diff().to(device).unsqueeze(-1)  # (B, L)
    kv_pad = torch.arange(n_k, device=device) >= cu_k.diff().to(device).unsqueeze(-1)  # (B, S)
    return q_pad, kv_pad


def read_te(bound: Mapping[str, Any]) -> QKCall:
    mod = bound["self"]
    for name in ("inference_params", "score_mod"):
        if bound.get(name) is not None:
            raise ValueError(f"DotProductAttention with {name}: not measured")
    a = te_arguments(bound)
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
    win = a.get("window_size")
    left, right = te_window(mask_type, getattr(mod, "window_size", None) if win is None else win)
    masks: dict[str, Any] = {"causal": "causal" in mask_type, "window": flash_window(left, right)}
    bias_type = a.get("core_attention_bias_type") or "no_bias"
    if bias_type == "alibi":
        slopes = a.get("alibi_slopes")
        masks["alibi"] = slopes if slopes is not None else alibi_slopes(q.shape[1], q.device)
    scale = softmax_scale(mod)
    call = QKCall(q, k, scale)
    positional = masks["causal"] or masks["window"] is not None or "alibi" in masks
    if fmt == "thd":
        call.positions = Positions.packed(
            a["cu_seqlens_q"],
            a["cu_seqlens_kv"],
            n_q,
            n_k,
            bottom_right=bool(bottom),
            starts_q=a.get("cu_seqlens_q_padded"),
            starts_k=a.get("cu_seqlens_kv_padded"),
            **masks,
        )
    elif "padding" in mask_type:
        q_pad, kv_pad = _padding(a, q.shape[0], n_q, n_k, q.device)
        call.allowed = ~q_pad.view(-1, 1, n_q, 1) & ~kv_pad.view(-1, 1, 1, n_k)  # padded queries: no row
        if positional:
            call.positions = Positions.aligned(n_q, n_k, q.device, bottom_right=False, **masks)
            if bottom:  # each row's actual lengths (TE's cu_seqlens)
                call.positions.row_offset = (~kv_pad).sum(-1) - (~q_pad).sum(-1)  # (B,)
    elif positional:
        call.positions = Positions.aligned(n_q, n_k, q.device, bottom_right=bool(bottom), **masks)
    mask = a.get("attention_mask")
    if mask is not None and mask_type == "arbitrary":
        call.allowed = ~mask.bool()
    bias = a.get("core_attention_bias")
    if bias is not None and bias_type in ("post_scale_bias", "pre_scale_bias"):
        call.bias = bias if bias_type == "post_scale_bias" else bias * (scale or q.shape[-1] ** -0.5)
    softmax_type = getattr(mod, "softmax_type", "vanilla")
    if softmax_type == "off-by-one":
        call.sinks = torch.zeros(q.shape[1], device=q.device)
    elif softmax_type == "learnable":
        call.sinks = mod.softmax_offset
    return call


TE_CLASS_PATHS = (
    "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention:DotProductAttention",
    "transformer_engine.pytorch.attention:DotProductAttention",  # TE <= 2.2: attention.py holds the class
)
"""Where ``DotProductAttention`` is defined: TE >= 2.3, then TE <= 2.2 (in 2.3+ the second path is a
re-export of the first, wrapped once)."""

TE = add(
    Kernel(
        "transformer_engine",
        "Transformer Engine",
        read_te,
        functions=tuple(f"{path}.forward" for path in TE_CLASS_PATHS),
        qk=("query_layer", "key_layer"),
        map_qk=map_te_qk,
    )
)
