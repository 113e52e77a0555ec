"""xformers ``memory_efficient_attention``: a Python entry point (its CUDA ops get reformatted
arguments), made visible by `entry_points` and read from its own arguments.

Layouts: BMHK (batch, seq, heads, dim), BMK (one head), BMGHK (groups × heads, keys expanded over the
heads of a group: one kv head per group). ``attn_bias``: None; a tensor added to the scores ((B, H,
Mq, Mk), or (B, G, H, Mq, Mk)); or an ``xformers.ops.fmha.attn_bias`` object, read by its class —
causal top-left (``LowerTriangularMask``, ``…WithTensorBias`` adding its ``_bias``), bottom-right
(``LowerTriangularFromBottomRightMask``), sliding windows (``…LocalAttention…`` with ``_window_size`` w:
the w keys up to the query's position; ``LocalAttentionFromBottomRightMask`` with ``window_left`` /
``window_right``), packed documents (``BlockDiagonal…`` with ``q_seqinfo.seqstart`` /
``k_seqinfo.seqstart``, causal top-left or bottom-right per document), and their padded-keys and
gappy-keys forms (``BlockDiagonal…PaddedKeysMask``, ``…GappyKeysMask``: key block b starts at
``k_seqinfo.seqstart[b]`` and holds ``k_seqinfo.seqlen[b]`` keys; the padding or gap after it is no key;
``CausalWithOffset`` is causal bottom-right by the used lengths). Paged biases (a KV cache in pages,
inference) are refused. Any other bias is materialised through its own ``materialize`` when that stays
small, else the call is refused (ValueError).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..call import Positions, QKCall
from ..readers import additive_allowed
from .base import Kernel, add

MATERIALISE_LIMIT = 1 << 24
"""Largest bias (entries) of an unknown class materialised for a measurement."""
_CAUSAL = {
    "LowerTriangularMask": "top_left",
    "LowerTriangularMaskWithTensorBias": "top_left",
    "LowerTriangularFromBottomRightMask": "bottom_right",
    "LowerTriangularFromBottomRightLocalAttentionMask": "bottom_right",
    "BlockDiagonalCausalMask": "top_left",
    "BlockDiagonalCausalLocalAttentionMask": "top_left",
    "BlockDiagonalCausalFromBottomRightMask": "bottom_right",
    "BlockDiagonalCausalLocalAttentionFromBottomRightMask": "bottom_right",
    "BlockDiagonalCausalWithOffsetPaddedKeysMask": "bottom_right",
    "BlockDiagonalCausalLocalAttentionPaddedKeysMask": "bottom_right",
    "BlockDiagonalCausalWithOffsetGappyKeysMask": "bottom_right",
}


def _heads_first(x: torch.Tensor, key: bool) -> torch.Tensor:
    """(B, M, H, K) / (B, M, K) / (B, M, G, H, K) -> (B, heads, M, K) views (keys of a group: one head)."""
    if x.dim() == 3:
        x = x.unsqueeze(2)
    elif x.dim() == 5:
        x = x[:, :, :, 0] if key and x.shape[3] > 1 and x.stride(3) == 0 else x.flatten(2, 3)
    return x.transpose(1, 2)


_TWO_SIDED = ("LocalAttentionFromBottomRightMask", "BlockDiagonalLocalAttentionPaddedKeysMask")
"""Biases with ``window_left`` / ``window_right`` around the bottom-right diagonal, not causal."""


def _packed(bias: Any, device: torch.device, n_q: int, n_k: int, **masks: Any) -> Positions:
    """The documents of a ``BlockDiagonal…`` bias. Its keys are packed back to back (``_SeqLenInfo``:
    ``seqstart`` (b + 1,) cumulative), or each block starts at ``seqstart[b]`` and holds ``seqlen[b]``
    keys (``_PaddedSeqLenInfo``: padded to ``padding``; ``_GappySeqInfo``: anywhere): the rest of a
    padded or gappy block is not a key."""
    cu_q = bias.q_seqinfo.seqstart.to(device)
    k_info = bias.k_seqinfo
    starts_k = k_info.seqstart.to(device)
    lengths = getattr(k_info, "seqlen", None)
    if lengths is None:
        return Positions.packed(cu_q, starts_k, n_q, n_k, **masks)
    lengths = lengths.to(device).long()
    cu_k = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    return Positions.packed(cu_q, cu_k, n_q, n_k, starts_k=starts_k, **masks)


def read_xformers(a: Mapping[str, Any]) -> QKCall:
    query, key, bias = a["query"], a["key"], a.get("attn_bias")
    q, k = _heads_first(query, key=False), _heads_first(key, key=True)
    call = QKCall(q, k, a.get("scale"))
    n_q, n_k = q.shape[2], k.shape[2]
    if bias is None:
        return call
    if isinstance(bias, torch.Tensor):
        t = bias.flatten(1, 2) if bias.dim() == 5 else (bias.unsqueeze(1) if bias.dim() == 3 else bias)
        call.allowed, call.bias = additive_allowed(t), t
        return call
    name = type(bias).__name__
    align = _CAUSAL.get(name)
    window = None
    w = getattr(bias, "_window_size", None)
    if "LocalAttention" in name and isinstance(w, int) and w > 0:
        window = (w - 1, 0)
    two_sided = name in _TWO_SIDED
    if two_sided:
        window, align = (int(bias.window_left), int(bias.window_right)), None
    masks: dict[str, Any] = {"causal": align is not None, "window": window}
    bottom = align == "bottom_right" or two_sided
    if name.startswith("Paged"):
        raise ValueError(f"xformers attention bias {name} (a paged KV cache, inference): not measured")
    if name.startswith("BlockDiagonal"):
        call.positions = _packed(bias, q.device, n_q, n_k, bottom_right=bottom, **masks)
    elif name in _CAUSAL or two_sided:
        call.positions = Positions.aligned(n_q, n_k, q.device, bottom_right=bottom, **masks)
    else:
        shape = (q.shape[0], q.shape[1], n_q, n_k)
        if q.shape[0] * q.shape[1] * n_q * n_k > MATERIALISE_LIMIT:
            raise ValueError(f"xformers attention bias {name}: not measured (too large to materialise)")
        t = bias.materialize(shape, dtype=torch.float32, device=q.device)
        call.allowed, call.bias = additive_allowed(t), t
        return call
    tensor_bias = getattr(bias, "_bias", None)
    if isinstance(tensor_bias, torch.Tensor):
        call.bias = tensor_bias.flatten(1, 2) if tensor_bias.dim() == 5 else tensor_bias
    return call


XFORMERS = add(
    Kernel(
        "xformers",
        "xformers",
        read_xformers,
        functions=("xformers.ops.fmha:memory_efficient_attention", "xformers.ops:memory_efficient_attention"),
        qk=("query", "key"),
    )
)
