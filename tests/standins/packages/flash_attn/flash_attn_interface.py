"""STAND-IN for ``flash_attn.flash_attn_interface`` (flash-attn 2.8.x), pure PyTorch, for CPU tests.

Followed: Dao-AILab/flash-attention @ 0251105a (2.8.4) ``flash_attn/flash_attn_interface.py`` (op names,
schemas, autograd Functions and public signatures copied), with the masking rules from
``csrc/flash_attn/flash_api.cpp`` and ``csrc/flash_attn/src/mask.h``.

Same as the real library:

- custom ops ``flash_attn::_flash_attn_forward``, ``flash_attn::_flash_attn_varlen_forward``,
  ``flash_attn::_flash_attn_backward``, ``flash_attn::_flash_attn_varlen_backward`` with the real
  schemas (registered with ``torch.library.custom_op`` + ``register_fake``), called by the
  ``torch.autograd.Function`` classes exactly as the real ones call them: the packed entry points
  unpack q/k/v first, the head dim is zero-padded to a multiple of 8 before the op (so the op sees
  the padded tensors) and the output is sliced back; the first five op arguments go positionally,
  the rest as keywords. A ``TorchFunctionMode`` therefore sees every entry point as an
  ``OpOverloadPacket`` call of one of the forward ops (and the backward ops during backward).
- semantics: layout (batch, seqlen, nheads, headdim) or (total, nheads, headdim) for varlen;
  softmax_scale defaults to 1/sqrt(headdim); GQA/MQA (query head h reads kv head h // (H / Hkv));
  with d = i + seqlen_k - seqlen_q (bottom-right alignment, per document for varlen), causal keeps
  keys j <= d; window_size (left, right) keeps d - left <= j <= d + right, -1 = unbounded side
  (causal forces right = 0); softcap > 0 applies softcap·tanh(s / softcap) to the scaled scores
  before masking; alibi_slopes (nheads,) or (batch, nheads) add -slope·|d - j|; a row with no allowed
  key gets zero output and softmax_lse = +inf (as the FA2 kernel writes).
- return values: out; softmax_lse (batch, nheads, seqlen_q) or (nheads, total_q) in float32;
  S_dmask empty unless return_softmax; rng_state int64 (2,).

Different from the real library (deliberately):

- runs on CPU (and CUDA) in any floating dtype (the kernel wants fp16/bf16 on CUDA); fp32 accumulation,
  fp64 inputs stay fp64;
- ``dropout_p > 0`` raises NotImplementedError (the real kernel's dropout mask comes from a CUDA
  Philox stream that a stand-in cannot reproduce); ``deterministic`` is accepted and ignored;
- varlen ``block_table`` (paged KV), ``leftpad_k``, ``seqused_k`` raise NotImplementedError;
- the backward ops compute the closed-form gradients in PyTorch (autograd is unavailable inside a
  custom op); gradients match autograd through a float64 softmax reference.
"""

# ruff: noqa: RUF005  (autograd Functions kept as in the real source)
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from _standin_attention_math import (
    alibi_bias,
    attention,
    attention_backward,
    compute_dtype,
    window_mask,
)

__standin__ = True

_DEVICE_TYPES = ("cpu", "cuda")


def maybe_contiguous(x):
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def round_multiple(x, m):
    return (x + m - 1) // m * m


def _no_dropout(dropout_p: float) -> None:
    if dropout_p > 0:
        raise NotImplementedError(
            "flash-attn stand-in: dropout_p > 0 is not implemented (the real kernel draws its dropout mask "
            "from a CUDA Philox stream); pass dropout_p=0.0"
        )


def _not_supported(**kwargs) -> None:
    for name, value in kwargs.items():
        if value is not None:
            raise NotImplementedError(f"flash-attn stand-in: `{name}` is not implemented")


def _doc_allowed(sq: int, sk: int, causal: bool, left: int, right: int, device) -> torch.Tensor:
    return window_mask(
        sq, sk, offset=sk - sq, causal=causal, window_left=left, window_right=right, device=device
    )


def _doc_bias(sq: int, sk: int, slopes: torch.Tensor | None, dtype) -> torch.Tensor | None:
    if slopes is None:
        return None
    return alibi_bias(sq, sk, slopes, offset=sk - sq, dtype=dtype)


def _dense_forward(q, k, v, scale, causal, left, right, softcap, alibi_slopes):
    """q (B, Sq, H, D), k/v (B, Sk, Hk, D) -> out (B, Sq, H, Dv) in q.dtype, lse (B, H, Sq) fp32, probs."""
    sq, sk = q.shape[1], k.shape[1]
    cd = compute_dtype(q.dtype)
    qt, kt, vt = (x.transpose(1, 2).to(cd) for x in (q, k, v))
    allowed = _doc_allowed(sq, sk, causal, left, right, q.device)
    out, lse, p = attention(
        qt,
        kt,
        vt,
        scale=scale,
        allowed=allowed,
        bias=_doc_bias(sq, sk, alibi_slopes, cd),
        softcap=softcap,
    )
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, math.inf), lse)  # FA2 writes +inf
    return out.transpose(1, 2).to(q.dtype), lse.float(), p


def _dense_backward(dout, q, k, v, scale, causal, left, right, softcap, alibi_slopes):
    sq, sk = q.shape[1], k.shape[1]
    cd = compute_dtype(q.dtype)
    dq, dk, dv, d = attention_backward(
        *(x.transpose(1, 2).to(cd) for x in (dout, q, k, v)),
        scale=scale,
        allowed=_doc_allowed(sq, sk, causal, left, right, q.device),
        bias=_doc_bias(sq, sk, alibi_slopes, cd),
        softcap=softcap,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), d


def _slopes_for(alibi_slopes, b):
    if alibi_slopes is None:
        return None
    return alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes


@torch.library.custom_op("flash_attn::_flash_attn_forward", mutates_args=(), device_types=_DEVICE_TYPES)
def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _no_dropout(dropout_p)
    q, k, v = [maybe_contiguous(x) for x in (q, k, v)]
    out, softmax_lse, p = _dense_forward(
        q, k, v, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes
    )
    batch_size, seqlen_q, num_heads, _ = q.shape
    seqlen_k = k.shape[1]
    S_dmask = torch.empty((0,), dtype=q.dtype, device=q.device)
    if return_softmax:
        S_dmask = torch.zeros(
            (batch_size, num_heads, round_multiple(seqlen_q, 128), round_multiple(seqlen_k, 128)),
            dtype=q.dtype,
            device=q.device,
        )
        S_dmask[:, :, :seqlen_q, :seqlen_k] = p.to(q.dtype)
    rng_state = torch.zeros((2,), dtype=torch.int64, device=q.device)
    return out, softmax_lse, S_dmask, rng_state


@torch.library.register_fake("flash_attn::_flash_attn_forward")
def _flash_attn_forward_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = [maybe_contiguous(x) for x in (q, k, v)]
    batch_size, seqlen_q, num_heads, _head_size = q.shape
    seqlen_k = k.shape[1]
    out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
    softmax_lse = torch.empty((batch_size, num_heads, seqlen_q), dtype=torch.float32, device=q.device)
    p = torch.empty((0,), dtype=q.dtype, device=q.device)
    if return_softmax:
        p = torch.empty(
            (batch_size, num_heads, round_multiple(seqlen_q, 128), round_multiple(seqlen_k, 128)),
            dtype=q.dtype,
            device=q.device,
        )
    rng_state = torch.empty((2,), dtype=torch.int64, device=q.device)
    return out, softmax_lse, p, rng_state


_wrapped_flash_attn_forward = torch.ops.flash_attn._flash_attn_forward


def _documents(cu_seqlens_q, cu_seqlens_k):
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    if len(cq) != len(ck):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length (batch_size + 1)")
    return list(zip(cq[:-1], cq[1:], ck[:-1], ck[1:]))


@torch.library.custom_op(
    "flash_attn::_flash_attn_varlen_forward", mutates_args=(), device_types=_DEVICE_TYPES
)
def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    return_softmax: bool = False,
    block_table: torch.Tensor | None = None,
    leftpad_k: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    zero_tensors: bool = False,
    num_splits: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _no_dropout(dropout_p)
    _not_supported(block_table=block_table, leftpad_k=leftpad_k, seqused_k=seqused_k)
    q, k, v = [maybe_contiguous(x) for x in (q, k, v)]
    total_q, num_heads, _ = q.shape
    out = torch.zeros((total_q, num_heads, v.shape[-1]), dtype=q.dtype, device=q.device)
    softmax_lse = torch.full((num_heads, total_q), math.inf, dtype=torch.float32, device=q.device)
    docs = _documents(cu_seqlens_q, cu_seqlens_k)
    S_dmask = torch.empty((0,), dtype=q.dtype, device=q.device)
    if return_softmax:
        S_dmask = torch.zeros(
            (len(docs), num_heads, round_multiple(max_seqlen_q, 128), round_multiple(max_seqlen_k, 128)),
            dtype=q.dtype,
            device=q.device,
        )
    for b, (q0, q1, k0, k1) in enumerate(docs):
        o, lse, p = _dense_forward(
            q[q0:q1].unsqueeze(0),
            k[k0:k1].unsqueeze(0),
            v[k0:k1].unsqueeze(0),
            softmax_scale,
            causal,
            window_size_left,
            window_size_right,
            softcap,
            _slopes_for(alibi_slopes, b),
        )
        out[q0:q1] = o[0]
        softmax_lse[:, q0:q1] = lse[0]
        if return_softmax:
            S_dmask[b, :, : q1 - q0, : k1 - k0] = p[0].to(q.dtype)
    rng_state = torch.zeros((2,), dtype=torch.int64, device=q.device)
    return out, softmax_lse, S_dmask, rng_state


@torch.library.register_fake("flash_attn::_flash_attn_varlen_forward")
def _flash_attn_varlen_forward_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    return_softmax: bool = False,
    block_table: torch.Tensor | None = None,
    leftpad_k: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    zero_tensors: bool = False,
    num_splits: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = [maybe_contiguous(x) for x in (q, k, v)]
    batch_size = cu_seqlens_q.numel() - 1
    total_q, num_heads, _ = q.shape
    out = torch.empty((total_q, num_heads, v.shape[-1]), dtype=q.dtype, device=q.device)
    softmax_lse = torch.empty((num_heads, total_q), dtype=torch.float32, device=q.device)
    p = torch.empty((0,), dtype=q.dtype, device=q.device)
    if return_softmax:
        p = torch.empty(
            (batch_size, num_heads, round_multiple(max_seqlen_q, 128), round_multiple(max_seqlen_k, 128)),
            dtype=q.dtype,
            device=q.device,
        )
    rng_state = torch.empty((2,), dtype=torch.int64, device=q.device)
    return out, softmax_lse, p, rng_state


_wrapped_flash_attn_varlen_forward = torch.ops.flash_attn._flash_attn_varlen_forward


def _write_grads(dq, dk, dv, grads, q_slice=slice(None), k_slice=slice(None)):
    gq, gk, gv = grads
    if dq is not None:
        dq[q_slice] = gq.to(dq.dtype)
    if dk is not None:
        dk[k_slice] = gk.to(dk.dtype)
    if dv is not None:
        dv[k_slice] = gv.to(dv.dtype)


@torch.library.custom_op(
    "flash_attn::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types=_DEVICE_TYPES
)
def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
) -> torch.Tensor:
    _no_dropout(dropout_p)
    gq, gk, gv, d = _dense_backward(
        dout, q, k, v, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes
    )
    _write_grads(dq, dk, dv, (gq, gk, gv))
    batch_size, seqlen_q, num_heads, _ = q.shape
    softmax_d = torch.zeros(
        (batch_size, num_heads, round_multiple(seqlen_q, 128)), dtype=torch.float32, device=q.device
    )
    softmax_d[:, :, :seqlen_q] = d
    return softmax_d


@torch.library.register_fake("flash_attn::_flash_attn_backward")
def _flash_attn_backward_fake(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
) -> torch.Tensor:
    batch_size, seqlen_q, num_heads, _ = q.shape
    return torch.empty(
        (batch_size, num_heads, round_multiple(seqlen_q, 128)), device=q.device, dtype=torch.float32
    )


_wrapped_flash_attn_backward = torch.ops.flash_attn._flash_attn_backward


@torch.library.custom_op(
    "flash_attn::_flash_attn_varlen_backward", mutates_args=("dq", "dk", "dv"), device_types=_DEVICE_TYPES
)
def _flash_attn_varlen_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
    zero_tensors: bool = False,
) -> torch.Tensor:
    _no_dropout(dropout_p)
    docs = _documents(cu_seqlens_q, cu_seqlens_k)
    for x in (dq, dk, dv):
        if x is not None:
            x.zero_()
    total_q, num_heads, _ = q.shape
    softmax_d = torch.zeros((num_heads, total_q + 128 * len(docs)), device=q.device, dtype=torch.float32)
    for b, (q0, q1, k0, k1) in enumerate(docs):
        gq, gk, gv, d = _dense_backward(
            dout[q0:q1].unsqueeze(0),
            q[q0:q1].unsqueeze(0),
            k[k0:k1].unsqueeze(0),
            v[k0:k1].unsqueeze(0),
            softmax_scale,
            causal,
            window_size_left,
            window_size_right,
            softcap,
            _slopes_for(alibi_slopes, b),
        )
        _write_grads(dq, dk, dv, (gq[0], gk[0], gv[0]), slice(q0, q1), slice(k0, k1))
        softmax_d[:, q0:q1] = d[0]
    return softmax_d


@torch.library.register_fake("flash_attn::_flash_attn_varlen_backward")
def _flash_attn_varlen_backward_fake(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
    zero_tensors: bool = False,
) -> torch.Tensor:
    batch_size = cu_seqlens_q.numel() - 1
    total_q, num_heads, _ = q.shape
    return torch.empty((num_heads, total_q + 128 * batch_size), device=q.device, dtype=torch.float32)


_wrapped_flash_attn_varlen_backward = torch.ops.flash_attn._flash_attn_varlen_backward


def _pad8(*xs):
    head_size_og = xs[0].size(-1)
    if head_size_og % 8 == 0:
        return xs
    return tuple(F.pad(x, [0, 8 - head_size_og % 8]) for x in xs)


# ----------------------------------------------------------------------------------------------
# autograd Functions: structure, argument order and op calls as in the real flash_attn_interface.py
# ----------------------------------------------------------------------------------------------


class FlashAttnQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        qkv,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_softmax,
        is_grad_enabled,
    ):
        is_grad = is_grad_enabled and qkv.requires_grad
        if softmax_scale is None:
            softmax_scale = qkv.shape[-1] ** (-0.5)
        q, k, v = qkv[:, :, 0].detach(), qkv[:, :, 1].detach(), qkv[:, :, 2].detach()
        head_size_og = q.size(3)
        q, k, v = _pad8(q, k, v)
        out_padded, softmax_lse, S_dmask, rng_state = _wrapped_flash_attn_forward(
            q,
            k,
            v,
            dropout_p,
            softmax_scale,
            causal=causal,
            window_size_left=window_size[0],
            window_size_right=window_size[1],
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            return_softmax=return_softmax and dropout_p > 0,
        )
        if is_grad:
            ctx.save_for_backward(q, k, v, out_padded, softmax_lse, rng_state)
            ctx.dropout_p = dropout_p
            ctx.softmax_scale = softmax_scale
            ctx.causal = causal
            ctx.window_size = window_size
            ctx.softcap = softcap
            ctx.alibi_slopes = alibi_slopes
            ctx.deterministic = deterministic
        out = out_padded[..., :head_size_og]
        return out if not return_softmax else (out, softmax_lse, S_dmask)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse, rng_state = ctx.saved_tensors
        qkv_shape = q.shape[:-2] + (3, *q.shape[-2:])
        dqkv = torch.empty(qkv_shape, dtype=q.dtype, device=q.device)
        (dout_padded,) = _pad8(dout)
        _wrapped_flash_attn_backward(
            dout_padded,
            q,
            k,
            v,
            out,
            softmax_lse,
            dqkv[:, :, 0],
            dqkv[:, :, 1],
            dqkv[:, :, 2],
            ctx.dropout_p,
            ctx.softmax_scale,
            ctx.causal,
            ctx.window_size[0],
            ctx.window_size[1],
            ctx.softcap,
            ctx.alibi_slopes,
            ctx.deterministic,
            rng_state=rng_state,
        )
        dqkv = dqkv[..., : dout.shape[-1]]  # We could have padded the head dimension
        return dqkv, None, None, None, None, None, None, None, None, None


class FlashAttnVarlenQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        qkv,
        cu_seqlens,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_softmax,
        is_grad_enabled,
    ):
        is_grad = is_grad_enabled and qkv.requires_grad
        if softmax_scale is None:
            softmax_scale = qkv.shape[-1] ** (-0.5)
        q, k, v = qkv[:, 0].detach(), qkv[:, 1].detach(), qkv[:, 2].detach()
        head_size_og = q.size(2)
        q, k, v = _pad8(q, k, v)
        out_padded, softmax_lse, S_dmask, rng_state = _wrapped_flash_attn_varlen_forward(
            q,
            k,
            v,
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            dropout_p,
            softmax_scale,
            causal=causal,
            window_size_left=window_size[0],
            window_size_right=window_size[1],
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            return_softmax=return_softmax and dropout_p > 0,
            block_table=None,
        )
        if is_grad:
            ctx.save_for_backward(q, k, v, out_padded, softmax_lse, cu_seqlens, rng_state)
            ctx.dropout_p = dropout_p
            ctx.max_seqlen = max_seqlen
            ctx.softmax_scale = softmax_scale
            ctx.causal = causal
            ctx.window_size = window_size
            ctx.softcap = softcap
            ctx.alibi_slopes = alibi_slopes
            ctx.deterministic = deterministic
        out = out_padded[..., :head_size_og]
        return out if not return_softmax else (out, softmax_lse, S_dmask)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse, cu_seqlens, rng_state = ctx.saved_tensors
        qkv_shape = q.shape[:-2] + (3, *q.shape[-2:])
        dqkv = torch.empty(qkv_shape, dtype=q.dtype, device=q.device)
        (dout_padded,) = _pad8(dout)
        _wrapped_flash_attn_varlen_backward(
            dout_padded,
            q,
            k,
            v,
            out,
            softmax_lse,
            dqkv[:, 0],
            dqkv[:, 1],
            dqkv[:, 2],
            cu_seqlens,
            cu_seqlens,
            ctx.max_seqlen,
            ctx.max_seqlen,
            ctx.dropout_p,
            ctx.softmax_scale,
            ctx.causal,
            ctx.window_size[0],
            ctx.window_size[1],
            ctx.softcap,
            ctx.alibi_slopes,
            ctx.deterministic,
            rng_state=rng_state,
        )
        dqkv = dqkv[..., : dout.shape[-1]]  # We could have padded the head dimension
        return dqkv, None, None, None, None, None, None, None, None, None, None, None


class FlashAttnKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q,
        kv,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_softmax,
        is_grad_enabled,
    ):
        is_grad = is_grad_enabled and any(x.requires_grad for x in [q, kv])
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        k, v = kv[:, :, 0].detach(), kv[:, :, 1].detach()
        head_size_og = q.size(3)
        q, k, v = _pad8(q, k, v)
        out_padded, softmax_lse, S_dmask, rng_state = _wrapped_flash_attn_forward(
            q,
            k,
            v,
            dropout_p,
            softmax_scale,
            causal=causal,
            window_size_left=window_size[0],
            window_size_right=window_size[1],
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            return_softmax=return_softmax and dropout_p > 0,
        )
        if is_grad:
            ctx.save_for_backward(q, k, v, out_padded, softmax_lse, rng_state)
            ctx.dropout_p = dropout_p
            ctx.softmax_scale = softmax_scale
            ctx.causal = causal
            ctx.window_size = window_size
            ctx.softcap = softcap
            ctx.alibi_slopes = alibi_slopes
            ctx.deterministic = deterministic
        out = out_padded[..., :head_size_og]
        return out if not return_softmax else (out, softmax_lse, S_dmask)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse, rng_state = ctx.saved_tensors
        dq = torch.empty_like(q)
        kv_shape = k.shape[:-2] + (2, *k.shape[-2:])
        dkv = torch.empty(kv_shape, dtype=k.dtype, device=k.device)
        (dout_padded,) = _pad8(dout)
        _wrapped_flash_attn_backward(
            dout_padded,
            q,
            k,
            v,
            out,
            softmax_lse,
            dq,
            dkv[:, :, 0],
            dkv[:, :, 1],
            ctx.dropout_p,
            ctx.softmax_scale,
            ctx.causal,
            ctx.window_size[0],
            ctx.window_size[1],
            ctx.softcap,
            ctx.alibi_slopes,
            ctx.deterministic,
            rng_state=rng_state,
        )
        dq = dq[..., : dout.shape[-1]]  # We could have padded the head dimension
        dkv = dkv[..., : dout.shape[-1]]
        return dq, dkv, None, None, None, None, None, None, None, None, None


class FlashAttnVarlenKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q,
        kv,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_softmax,
        is_grad_enabled,
    ):
        is_grad = is_grad_enabled and any(x.requires_grad for x in [q, kv])
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        k, v = kv[:, 0].detach(), kv[:, 1].detach()
        head_size_og = q.size(2)
        q, k, v = _pad8(q, k, v)
        out_padded, softmax_lse, S_dmask, rng_state = _wrapped_flash_attn_varlen_forward(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            dropout_p,
            softmax_scale,
            causal=causal,
            window_size_left=window_size[0],
            window_size_right=window_size[1],
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            return_softmax=return_softmax and dropout_p > 0,
            block_table=None,
        )
        if is_grad:
            ctx.save_for_backward(q, k, v, out_padded, softmax_lse, cu_seqlens_q, cu_seqlens_k, rng_state)
            ctx.dropout_p = dropout_p
            ctx.max_seqlen_q = max_seqlen_q
            ctx.max_seqlen_k = max_seqlen_k
            ctx.softmax_scale = softmax_scale
            ctx.causal = causal
            ctx.window_size = window_size
            ctx.softcap = softcap
            ctx.alibi_slopes = alibi_slopes
            ctx.deterministic = deterministic
        out = out_padded[..., :head_size_og]
        return out if not return_softmax else (out, softmax_lse, S_dmask)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, rng_state = ctx.saved_tensors
        dq = torch.empty_like(q)
        kv_shape = k.shape[:-2] + (2, *k.shape[-2:])
        dkv = torch.empty(kv_shape, dtype=k.dtype, device=k.device)
        (dout_padded,) = _pad8(dout)
        _wrapped_flash_attn_varlen_backward(
            dout_padded,
            q,
            k,
            v,
            out,
            softmax_lse,
            dq,
            dkv[:, 0],
            dkv[:, 1],
            cu_seqlens_q,
            cu_seqlens_k,
            ctx.max_seqlen_q,
            ctx.max_seqlen_k,
            ctx.dropout_p,
            ctx.softmax_scale,
            ctx.causal,
            ctx.window_size[0],
            ctx.window_size[1],
            ctx.softcap,
            ctx.alibi_slopes,
            ctx.deterministic,
            rng_state=rng_state,
        )
        dq = dq[..., : dout.shape[-1]]  # We could have padded the head dimension
        dkv = dkv[..., : dout.shape[-1]]
        return dq, dkv, None, None, None, None, None, None, None, None, None, None, None, None, None


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_softmax,
        is_grad_enabled,
    ):
        is_grad = is_grad_enabled and any(x.requires_grad for x in [q, k, v])
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        head_size_og = q.size(3)
        q, k, v = _pad8(q, k, v)
        out_padded, softmax_lse, S_dmask, rng_state = _wrapped_flash_attn_forward(
            q,
            k,
            v,
            dropout_p,
            softmax_scale,
            causal=causal,
            window_size_left=window_size[0],
            window_size_right=window_size[1],
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            return_softmax=return_softmax and dropout_p > 0,
        )
        if is_grad:
            ctx.save_for_backward(q, k, v, out_padded, softmax_lse, rng_state)
            ctx.dropout_p = dropout_p
            ctx.softmax_scale = softmax_scale
            ctx.causal = causal
            ctx.window_size = window_size
            ctx.softcap = softcap
            ctx.alibi_slopes = alibi_slopes
            ctx.deterministic = deterministic
        out = out_padded[..., :head_size_og]
        return out if not return_softmax else (out, softmax_lse, S_dmask)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse, rng_state = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        (dout_padded,) = _pad8(dout)
        _wrapped_flash_attn_backward(
            dout_padded,
            q,
            k,
            v,
            out,
            softmax_lse,
            dq,
            dk,
            dv,
            ctx.dropout_p,
            ctx.softmax_scale,
            ctx.causal,
            ctx.window_size[0],
            ctx.window_size[1],
            ctx.softcap,
            ctx.alibi_slopes,
            ctx.deterministic,
            rng_state=rng_state,
        )
        dq = dq[..., : dout.shape[-1]]  # We could have padded the head dimension
        dk = dk[..., : dout.shape[-1]]
        dv = dv[..., : dout.shape[-1]]
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


class FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_softmax,
        block_table,
        is_grad_enabled,
    ):
        is_grad = is_grad_enabled and any(x.requires_grad for x in [q, k, v])
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        head_size_og = q.size(2)
        q, k, v = _pad8(q, k, v)
        out_padded, softmax_lse, S_dmask, rng_state = _wrapped_flash_attn_varlen_forward(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            dropout_p,
            softmax_scale,
            causal=causal,
            window_size_left=window_size[0],
            window_size_right=window_size[1],
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            return_softmax=return_softmax and dropout_p > 0,
            block_table=block_table,
        )
        if is_grad:
            ctx.save_for_backward(q, k, v, out_padded, softmax_lse, cu_seqlens_q, cu_seqlens_k, rng_state)
            ctx.dropout_p = dropout_p
            ctx.max_seqlen_q = max_seqlen_q
            ctx.max_seqlen_k = max_seqlen_k
            ctx.softmax_scale = softmax_scale
            ctx.causal = causal
            ctx.window_size = window_size
            ctx.softcap = softcap
            ctx.alibi_slopes = alibi_slopes
            ctx.deterministic = deterministic

        out = out_padded[..., :head_size_og]
        return out if not return_softmax else (out, softmax_lse, S_dmask)

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, rng_state = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        (dout_padded,) = _pad8(dout)
        _wrapped_flash_attn_varlen_backward(
            dout_padded,
            q,
            k,
            v,
            out,
            softmax_lse,
            dq,
            dk,
            dv,
            cu_seqlens_q,
            cu_seqlens_k,
            ctx.max_seqlen_q,
            ctx.max_seqlen_k,
            ctx.dropout_p,
            ctx.softmax_scale,
            ctx.causal,
            ctx.window_size[0],
            ctx.window_size[1],
            ctx.softcap,
            ctx.alibi_slopes,
            ctx.deterministic,
            rng_state=rng_state,
        )
        dq = dq[..., : dout.shape[-1]]  # We could have padded the head dimension
        dk = dk[..., : dout.shape[-1]]
        dv = dv[..., : dout.shape[-1]]
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None, None, None, None


# ----------------------------------------------------------------------------------------------
# public API (signatures and defaults as in flash-attn 2.8.4; see the real docstrings for details)
# ----------------------------------------------------------------------------------------------


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # <=0.0 means deactivate
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv: (batch_size, seqlen, 3, nheads, headdim) -> out (batch_size, seqlen, nheads, headdim)."""
    return FlashAttnQKVPackedFunc.apply(
        qkv,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        torch.is_grad_enabled(),
    )


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q: (batch_size, seqlen_q, nheads, headdim), kv: (batch_size, seqlen_k, 2, nheads_k, headdim)."""
    return FlashAttnKVPackedFunc.apply(
        q,
        kv,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        torch.is_grad_enabled(),
    )


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q: (batch_size, seqlen_q, nheads, headdim), k/v: (batch_size, seqlen_k, nheads_k, headdim).

    Causal is aligned to the bottom right of the attention matrix; query i sees keys in
    [i + seqlen_k - seqlen_q - window_size[0], i + seqlen_k - seqlen_q + window_size[1]] (module docstring).
    """
    return FlashAttnFunc.apply(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        torch.is_grad_enabled(),
    )


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv: (total, 3, nheads, headdim), cu_seqlens: (batch_size + 1,) int32."""
    return FlashAttnVarlenQKVPackedFunc.apply(
        qkv,
        cu_seqlens,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        torch.is_grad_enabled(),
    )


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q: (total_q, nheads, headdim), kv: (total_k, 2, nheads_k, headdim)."""
    return FlashAttnVarlenKVPackedFunc.apply(
        q,
        kv,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        torch.is_grad_enabled(),
    )


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """q: (total_q, nheads, headdim), k/v: (total_k, nheads_k, headdim); per-document masking."""
    return FlashAttnVarlenFunc.apply(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
        block_table,
        torch.is_grad_enabled(),
    )


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    softcap=0.0,  # 0.0 means deactivated
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """Inference helper (no backward, as in the real library; it calls no custom op there either).

    Supported subset: k/v appended in place at ``cache_seqlens``, ``cache_batch_idx``, causal/window/
    softcap/alibi over each row's first cache_seqlens (+ new) keys. Rotary, paged (block_table) and
    cache_leftpad raise NotImplementedError.
    """
    _not_supported(
        rotary_cos=rotary_cos, rotary_sin=rotary_sin, block_table=block_table, cache_leftpad=cache_leftpad
    )
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    batch = q.shape[0]
    if cache_seqlens is None:
        lengths = [k_cache.shape[1]] * batch
    elif isinstance(cache_seqlens, int):
        lengths = [cache_seqlens] * batch
    else:
        lengths = [int(x) for x in cache_seqlens.tolist()]
    rows = list(range(batch)) if cache_batch_idx is None else [int(x) for x in cache_batch_idx.tolist()]
    outs, lses = [], []
    for b in range(batch):
        r, n = rows[b], lengths[b]
        if k is not None:
            new = k.shape[1]
            k_cache[r, n : n + new] = k[b]
            v_cache[r, n : n + new] = v[b]
            n += new
        o, lse, _ = _dense_forward(
            q[b : b + 1],
            k_cache[r : r + 1, :n],
            v_cache[r : r + 1, :n],
            softmax_scale,
            causal,
            window_size[0],
            window_size[1],
            softcap,
            _slopes_for(alibi_slopes, b),
        )
        outs.append(o)
        lses.append(lse)
    out, softmax_lse = torch.cat(outs), torch.cat(lses)
    return (out, softmax_lse) if return_softmax_lse else out
