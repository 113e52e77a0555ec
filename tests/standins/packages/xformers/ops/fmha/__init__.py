"""STAND-IN for ``xformers.ops.fmha`` (pure PyTorch, tests only; see ``tests/standins/__init__.py``).

Followed: facebookresearch/xformers @ bed3978b (0.0.35) ``xformers/ops/fmha/__init__.py`` (public
signatures) and ``xformers/ops/fmha/common.py`` (``Inputs.validate_inputs`` / ``normalize_bmhk``).

``memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None,
output_dtype=None)`` computes, as the real docstring's "equivalent pytorch code" says::

    scale = 1 / query.shape[-1] ** 0.5 (if None); attn = (query * scale) @ key^T (+ attn_bias);
    attn = attn.softmax(-1); attn = dropout(attn, p); out = attn @ value

Layouts: BMHK ``[B, M, H, K]``; BMK ``[B, M, K]`` (H = 1); BMGHK ``[B, M, G, H, K]`` for grouped heads
(GQA/MQA): key/value must be *expanded* to the same G, H as the query (xformers does not broadcast).
``attn_bias`` is None, a tensor of shape ``[B, H, Mq, Mk]`` (BMHK; ``[B, G, H, Mq, Mk]`` for BMGHK,
``[B, Mq, Mk]`` for BMK), or an ``attn_bias.AttentionBias`` — the stand-in reads every bias through its
real ``materialize`` method. Block-diagonal biases need batch size 1 (packed sequences), as in xformers.

Stand-in specifics: ``op`` is accepted and ignored (the real library dispatches to a CUDA kernel and
runs its own torch ops, e.g. ``xformers::efficient_attention_forward_cutlass``; the stand-in calls no
custom op, so an interceptor has to wrap this Python function, which ``xformers.ops`` re-exports as the
same object). Rows with no allowed key give zero output. Dropout uses torch's RNG. Gradients (q, k, v
and a tensor bias) come from autograd through plain torch math (no torch.softmax / SDPA call inside).
"""

from __future__ import annotations

import torch
from _standin_attention_math import attention, compute_dtype

from . import attn_bias
from .attn_bias import (
    AttentionBias,
    BlockDiagonalMask,
    LowerTriangularMask,
    LowerTriangularMaskWithTensorBias,
)

__standin__ = True


class _StandinOp:
    """Placeholder for xformers' operator classes; ``op=`` is accepted and ignored by the stand-in."""

    def __init__(self, name: str) -> None:
        self.NAME = name

    def __repr__(self) -> str:
        return f"<xformers stand-in op {self.NAME}>"


MemoryEfficientAttentionCutlassOp = (_StandinOp("cutlassF-pt"), _StandinOp("cutlassB-pt"))
MemoryEfficientAttentionCutlassFwdFlashBwOp = (_StandinOp("cutlassF-pt"), _StandinOp("fa2B"))
MemoryEfficientAttentionFlashAttentionOp = (_StandinOp("fa2F"), _StandinOp("fa2B"))
MemoryEfficientAttentionCkOp = (_StandinOp("ckF"), _StandinOp("ckB"))
MemoryEfficientAttentionSplitKCkOp = (_StandinOp("ck_splitKF"), _StandinOp("ckB"))
AttentionOp = tuple
AttentionOpBase = _StandinOp


def _validate(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_bias, p: float) -> None:
    """The checks of xformers' ``Inputs.validate_inputs`` that apply to the supported subset."""
    qkv = (query, key, value)
    if query.ndim not in (3, 4, 5) or any(x.ndim != query.ndim for x in qkv):
        raise ValueError(
            "Query/Key/Value should all have BMGHK, BMHK or BMK shape.\n"
            f"  query.shape: {query.shape}\n  key.shape  : {key.shape}\n  value.shape: {value.shape}"
        )
    if any(x.dtype != query.dtype for x in qkv):
        raise ValueError("Query/Key/Value should all have the same dtype")
    if query.ndim == 3 and not (attn_bias is None or type(attn_bias) in (LowerTriangularMask, torch.Tensor)):
        raise ValueError(
            f"Please provide inputs in BMHK format rather than BMK when using bias type `{type(attn_bias).__name__}`"
        )
    bias_t = attn_bias._bias if isinstance(attn_bias, LowerTriangularMaskWithTensorBias) else attn_bias
    if isinstance(bias_t, torch.Tensor) and query.ndim >= 4:
        expected = (query.shape[0], *query.shape[2:-1], query.shape[1], key.shape[1])
        if tuple(bias_t.shape) != tuple(expected):
            raise ValueError(f"Invalid shape for attention bias: {tuple(bias_t.shape)} (expected {expected})")
    if isinstance(attn_bias, BlockDiagonalMask) and any(x.shape[0] != 1 for x in qkv):
        raise ValueError("Expected batch_size=1 when using block-diagonal bias")
    if p < 0.0 or p > 1.0:
        raise ValueError(f"Invalid dropout probability: p={p}")
    B = query.shape[0]
    Mkv = key.shape[1]
    heads = query.shape[2:-1]
    K, Kv = query.shape[-1], value.shape[-1]
    if key.shape != (B, Mkv, *heads, K) or value.shape != (B, Mkv, *heads, Kv):
        raise ValueError(
            "Incompatible shapes for attention inputs:\n"
            f"  query.shape: {query.shape}\n  key.shape  : {key.shape}\n  value.shape: {value.shape}\n"
            "HINT: We don't support broadcasting, please use `expand` "
            "yourself before calling `memory_efficient_attention` if you need to"
        )


def _forward(query, key, value, attn_bias, p, scale, output_dtype):
    """Returns (out in BM(G)HK layout, lse (B, heads..., Mq))."""
    _validate(query, key, value, attn_bias, p)
    bmk = query.ndim == 3
    if bmk:
        query, key, value = query.unsqueeze(2), key.unsqueeze(2), value.unsqueeze(2)
        if isinstance(attn_bias, torch.Tensor):
            attn_bias = attn_bias.unsqueeze(1)
    B, Mq = query.shape[:2]
    Mkv = key.shape[1]
    heads = tuple(query.shape[2:-1])  # (H,) or (G, H)
    nh = 1
    for h in heads:
        nh *= h
    cd = compute_dtype(query.dtype)

    def bhmk(x):  # (B, M, *heads, K) -> (B, nh, M, K)
        return x.reshape(x.shape[0], x.shape[1], nh, x.shape[-1]).transpose(1, 2).to(cd)

    bias = None
    if isinstance(attn_bias, torch.Tensor):
        bias = attn_bias.to(cd)
    elif isinstance(attn_bias, AttentionBias):
        bias = attn_bias.materialize((B, *heads, Mq, Mkv), dtype=cd, device=query.device)
    elif attn_bias is not None:
        raise ValueError(f"unsupported attn_bias {type(attn_bias).__name__}")
    if bias is not None:
        bias = bias.reshape(bias.shape[0], nh, Mq, Mkv)
    if scale is None:
        scale = query.shape[-1] ** (-0.5)
    out, lse, _ = attention(bhmk(query), bhmk(key), bhmk(value), scale=scale, bias=bias, dropout_p=p)
    out = out.transpose(1, 2).reshape(B, Mq, *heads, value.shape[-1])
    if bmk:
        out = out.squeeze(2)
    out = out.to(output_dtype if output_dtype is not None else query.dtype)
    return out, lse.reshape(B, *heads, Mq).float()


def memory_efficient_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | AttentionBias | None = None,
    p: float = 0.0,
    scale: float | None = None,
    *,
    op=None,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Attention in BMHK / BMK / BMGHK layout with an optional bias; see the module docstring.

    :parameter query: Tensor of shape ``[B, Mq, H, K]``
    :parameter key: Tensor of shape ``[B, Mkv, H, K]``
    :parameter value: Tensor of shape ``[B, Mkv, H, Kv]``
    :return: multi-head attention Tensor with shape ``[B, Mq, H, Kv]``
    """
    return _forward(query, key, value, attn_bias, p, scale, output_dtype)[0]


def memory_efficient_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | AttentionBias | None = None,
    p: float = 0.0,
    scale: float | None = None,
    *,
    op=None,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Forward pass of ``memory_efficient_attention`` (the stand-in still records autograd history)."""
    return _forward(query, key, value, attn_bias, p, scale, output_dtype)[0]


def memory_efficient_attention_forward_requires_grad(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | AttentionBias | None = None,
    p: float = 0.0,
    scale: float | None = None,
    *,
    op=None,
    output_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(output, lse)``; lse is (B, H, Mq) float32 (-inf for rows with no allowed key)."""
    if p != 0.0:
        raise NotImplementedError(
            "dropout is not supported on the non-autograd API."
            " If you want to use dropout, please call `memory_efficient_attention` directly"
        )
    out, lse = _forward(query, key, value, attn_bias, p, scale, output_dtype)
    return out.detach(), lse.detach()


def memory_efficient_attention_backward(
    grad: torch.Tensor,
    output: torch.Tensor,
    lse: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_bias: torch.Tensor | AttentionBias | None = None,
    p: float = 0.0,
    scale: float | None = None,
    *,
    op=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(dq, dk, dv)`` by recomputing the forward under autograd."""
    if p != 0.0:
        raise NotImplementedError(
            "dropout is not supported on the non-autograd API."
            " If you want to use dropout, please call `memory_efficient_attention` directly"
        )
    with torch.enable_grad():
        q, k, v = (x.detach().requires_grad_() for x in (query, key, value))
        out, _ = _forward(q, k, v, attn_bias, 0.0, scale, output.dtype)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), grad)
    return dq, dk, dv


__all__ = [
    "AttentionBias",
    "AttentionOp",
    "AttentionOpBase",
    "BlockDiagonalMask",
    "LowerTriangularMask",
    "MemoryEfficientAttentionCkOp",
    "MemoryEfficientAttentionCutlassFwdFlashBwOp",
    "MemoryEfficientAttentionCutlassOp",
    "MemoryEfficientAttentionFlashAttentionOp",
    "MemoryEfficientAttentionSplitKCkOp",
    "attn_bias",
    "memory_efficient_attention",
    "memory_efficient_attention_backward",
    "memory_efficient_attention_forward",
    "memory_efficient_attention_forward_requires_grad",
]
