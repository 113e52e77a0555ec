"""STAND-IN for flash-attn 3's ``flash_attn_interface`` module, pure PyTorch, for CPU tests.

Followed: Dao-AILab/flash-attention @ 0251105a ``hopper/flash_attn_interface.py`` (op names, schemas,
autograd Functions, public signatures), masking from ``hopper/mask.h`` and ``hopper/flash_api.cpp``.
The real FA3 wheel installs this top-level module (plus the ``flash_attn_3`` package); Hugging Face's
``flash_attention_3`` path does ``from flash_attn_interface import flash_attn_func, ...``.

Same as the real library:

- custom ops ``flash_attn_3::_flash_attn_forward`` (34 arguments: q, k, v, k_new, v_new, qv, out_,
  cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
  page_table, kv_batch_idx, leftpad_k, rotary_cos, rotary_sin, seqlens_rotary, q_descale, k_descale,
  v_descale, softmax_scale, causal, window_size_left, window_size_right, attention_chunk, softcap,
  rotary_interleaved, scheduler_metadata, num_splits, pack_gqa, sm_margin) -> (out, softmax_lse,
  out_accum, softmax_lse_accum) and ``flash_attn_3::_flash_attn_backward`` (mutates dq, dk, dv), with
  ``register_fake`` and ``register_autograd`` on the forward op; the autograd Functions call the op
  through the ``CustomOpDef`` object exactly as the real ones do (a ``TorchFunctionMode`` sees an
  ``OpOverload``, ``flash_attn_3._flash_attn_forward.default``). No head-dim padding (FA3 has none).
- semantics: layout (batch, seqlen, nheads, headdim); varlen when cu_seqlens_q / cu_seqlens_k are given
  ((total, nheads, headdim), per document); softmax_scale defaults to 1/sqrt(headdim); GQA/MQA; with
  d = i + seqlen_k - seqlen_q (bottom-right, per document; seqlens after ``seqused_q``/``seqused_k``),
  causal keeps j <= d; window_size (left, right) keeps d - left <= j <= d + right (-1 = unbounded;
  causal forces right = 0); **attention_chunk** = c > 0 keeps only keys in the chunk of d, i.e.
  floor(d / c)·c <= j < floor(d / c)·c + c, intersected with causal/window (``mask.h``: the chunk
  limits are computed from row_idx + seqlen_k - seqlen_q, in key coordinates, and the window is
  clipped to c - 1 on both sides); softcap > 0 applies softcap·tanh(s / softcap) before masking; no
  alibi, no dropout (FA3 has neither). A row with no allowed key gets zero output, lse = -inf.
- the backward has no ``attention_chunk`` argument and the autograd Functions assert
  ``attention_chunk == 0`` in backward ("FA3 backward does not support attention_chunk"), as the real one.

Different from the real library (deliberately): CPU/any float dtype; k_new/v_new (KV-cache append),
qv, out_, page_table, kv_batch_idx, leftpad_k, rotary and the fp8 descale factors raise
NotImplementedError; scheduler_metadata / num_splits / pack_gqa / sm_margin (performance knobs) are
accepted and ignored; ``out_accum`` / ``softmax_lse_accum`` are always empty.
"""

# ruff: noqa: RUF005, RUF059  (autograd Functions kept as in the real source)
from __future__ import annotations

import math

import torch
from _standin_attention_math import attention, attention_backward, compute_dtype, window_mask

__standin__ = True

_DEVICE_TYPES = ("cpu", "cuda")


def maybe_contiguous(x):
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def round_multiple(x, m):
    return (x + m - 1) // m * m


def _not_supported(**kwargs) -> None:
    for name, value in kwargs.items():
        if value is not None:
            raise NotImplementedError(f"flash-attn 3 stand-in: `{name}` is not implemented")


def _segments(x, cu_seqlens, seqused, batch_size):
    """[(start, used_length)] per batch entry; varlen via cu_seqlens, else one row of x per entry."""
    if cu_seqlens is not None:
        cu = [int(c) for c in cu_seqlens.tolist()]
        segs = [(cu[b], cu[b + 1] - cu[b]) for b in range(len(cu) - 1)]
    else:
        segs = [(b, x.shape[1]) for b in range(batch_size)]
    if seqused is not None:
        used = [int(u) for u in seqused.tolist()]
        segs = [(s, min(n, used[b])) for b, (s, n) in enumerate(segs)]
    return segs


def _rows(x, varlen, start, n):
    """(1, n, heads, dim) slice of document ``start`` (varlen) or batch row ``start``."""
    return x[start : start + n].unsqueeze(0) if varlen else x[start : start + 1, :n]


def _doc_allowed(sq, sk, causal, left, right, chunk, device):
    return window_mask(
        sq,
        sk,
        offset=sk - sq,
        causal=causal,
        window_left=left,
        window_right=right,
        chunk=chunk,
        device=device,
    )


def _descaled(x, descale, b, heads):
    """(1, heads, n, d) ``x`` times its FP8 descale factor of batch entry ``b``: ``descale`` is
    (batch, num_heads_k), one factor per kv head, repeated over the query heads of a group."""
    if descale is None:
        return x
    per_head = descale[b].to(x.dtype).repeat_interleave(heads // descale.shape[1])  # (heads,)
    return x * per_head.view(1, heads, 1, 1)


def _forward_impl(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    seqused_q,
    seqused_k,
    scale,
    causal,
    left,
    right,
    chunk,
    softcap,
    descale=(None, None, None),
):
    varlen_q, varlen_k = cu_seqlens_q is not None, cu_seqlens_k is not None
    batch_size = cu_seqlens_q.numel() - 1 if varlen_q else q.shape[0]
    qsegs = _segments(q, cu_seqlens_q, seqused_q, batch_size)
    ksegs = _segments(k, cu_seqlens_k, seqused_k, batch_size)
    num_heads = q.shape[-2]
    fp8 = q.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    out_dtype = torch.bfloat16 if fp8 else q.dtype  # FA3's FP8 path writes a bf16 output
    out = torch.zeros((*q.shape[:-1], v.shape[-1]), dtype=out_dtype, device=q.device)
    if varlen_q:
        lse = torch.full((num_heads, q.shape[0]), -math.inf, dtype=torch.float32, device=q.device)
    else:
        lse = torch.full((batch_size, num_heads, q.shape[1]), -math.inf, dtype=torch.float32, device=q.device)
    cd = compute_dtype(q.dtype)
    for b in range(batch_size):
        (q0, nq), (k0, nk) = qsegs[b], ksegs[b]
        qb = _descaled(_rows(q, varlen_q, q0, nq).transpose(1, 2).to(cd), descale[0], b, num_heads)
        kb = _descaled(_rows(k, varlen_k, k0, nk).transpose(1, 2).to(cd), descale[1], b, k.shape[-2])
        vb = _descaled(_rows(v, varlen_k, k0, nk).transpose(1, 2).to(cd), descale[2], b, v.shape[-2])
        o, lse_b, _ = attention(
            qb,
            kb,
            vb,
            scale=scale,
            allowed=_doc_allowed(nq, nk, causal, left, right, chunk, q.device),
            softcap=softcap,
        )
        o = o[0].transpose(0, 1).to(out_dtype)
        if varlen_q:
            out[q0 : q0 + nq] = o
            lse[:, q0 : q0 + nq] = lse_b[0].float()
        else:
            out[b, :nq] = o
            lse[b, :, :nq] = lse_b[0].float()
    return out, lse


FWD_SCHEMA = (
    "fwd("
    "Tensor q,"
    "Tensor k,"
    "Tensor v,"
    "Tensor(k_new!)? k_new = None,"
    "Tensor(v_new!)? v_new = None,"
    "Tensor? q_v = None,"
    "Tensor(out!)? out = None,"
    "Tensor? cu_seqlens_q = None,"
    "Tensor? cu_seqlens_k = None,"
    "Tensor? cu_seqlens_k_new = None,"
    "Tensor? seqused_q = None,"
    "Tensor? seqused_k = None,"
    "int? max_seqlen_q = None,"
    "int? max_seqlen_k = None,"
    "Tensor? page_table = None,"
    "Tensor? kv_batch_idx = None,"
    "Tensor? leftpad_k = None,"
    "Tensor? rotary_cos = None,"
    "Tensor? rotary_sin = None,"
    "Tensor? seqlens_rotary = None,"
    "Tensor? q_descale = None,"
    "Tensor? k_descale = None,"
    "Tensor? v_descale = None,"
    "float? softmax_scale = None,"
    "bool is_causal = False,"
    "int window_size_left = -1,"
    "int window_size_right = -1,"
    "int attention_chunk = 0,"
    "float softcap = 0.0,"
    "bool is_rotary_interleaved = False,"
    "Tensor? scheduler_metadata = None,"
    "int num_splits = 0,"
    "bool? pack_gqa = None,"
    "int sm_margin = 0) -> (Tensor(out!), Tensor, Tensor, Tensor)"
)
"""``flash_attn_3::fwd`` as ``hopper/flash_api.cpp`` registers it (``TORCH_LIBRARY(flash_attn_3, m)``, the same
in ``flash_api_stable.cpp``): the C++ forward every FA3 build from mid-2025 on exposes. Builds between
db4baba2 (2025-05-22) and c7697bbf (2025-07-16) call it straight from the Python ``_flash_attn_forward``
(a plain function then, ``flash_attn_3_cuda = torch.ops.flash_attn_3``); later ones from inside the
``flash_attn_3::_flash_attn_forward`` custom op, as below."""

_LIB = torch.library.Library("flash_attn_3", "FRAGMENT")  # kept alive: the op lives while it does
_LIB.define(FWD_SCHEMA)


def _fwd(
    q,
    k,
    v,
    k_new=None,
    v_new=None,
    q_v=None,
    out=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    cu_seqlens_k_new=None,
    seqused_q=None,
    seqused_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    page_table=None,
    kv_batch_idx=None,
    leftpad_k=None,
    rotary_cos=None,
    rotary_sin=None,
    seqlens_rotary=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    is_causal=False,
    window_size_left=-1,
    window_size_right=-1,
    attention_chunk=0,
    softcap=0.0,
    is_rotary_interleaved=False,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
):
    _not_supported(
        k_new=k_new,
        v_new=v_new,
        qv=q_v,
        out_=out,
        cu_seqlens_k_new=cu_seqlens_k_new,
        page_table=page_table,
        kv_batch_idx=kv_batch_idx,
        leftpad_k=leftpad_k,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        seqlens_rotary=seqlens_rotary,
    )
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    result, softmax_lse = _forward_impl(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        seqused_q,
        seqused_k,
        softmax_scale,
        is_causal,
        window_size_left,
        window_size_right,
        attention_chunk,
        softcap,
        (q_descale, k_descale, v_descale),
    )
    empty = torch.tensor([], device=result.device)
    return result, softmax_lse, empty, empty.clone()


for _key in ("CPU", "CUDA"):
    _LIB.impl("fwd", _fwd, _key)
flash_attn_3_gpu = torch.ops.flash_attn_3


@torch.library.custom_op("flash_attn_3::_flash_attn_forward", mutates_args=(), device_types=_DEVICE_TYPES)
def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    qv: torch.Tensor | None = None,
    out_: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    cu_seqlens_k_new: torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    page_table: torch.Tensor | None = None,
    kv_batch_idx: torch.Tensor | None = None,
    leftpad_k: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    seqlens_rotary: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size_left: int = -1,
    window_size_right: int = -1,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    scheduler_metadata: torch.Tensor | None = None,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    sm_margin: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, k_new, v_new = [maybe_contiguous(x) for x in (q, k, k_new, v_new)]
    v = v.contiguous() if v.stride(-1) != 1 and v.stride(-3) != 1 else v
    out, softmax_lse, out_accum, softmax_lse_accum = flash_attn_3_gpu.fwd(
        q,
        k,
        v,
        k_new,
        v_new,
        qv,
        out_,
        cu_seqlens_q,
        cu_seqlens_k,
        cu_seqlens_k_new,
        seqused_q,
        seqused_k,
        max_seqlen_q,
        max_seqlen_k,
        page_table,
        kv_batch_idx,
        leftpad_k,
        rotary_cos,
        rotary_sin,
        seqlens_rotary,
        q_descale,
        k_descale,
        v_descale,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        attention_chunk,
        softcap,
        rotary_interleaved,
        scheduler_metadata,
        num_splits,
        pack_gqa,
        sm_margin,
    )
    return out, softmax_lse, out_accum, softmax_lse_accum


@torch.library.register_fake("flash_attn_3::_flash_attn_forward")
def _flash_attn_forward_fake(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    qv: torch.Tensor | None = None,
    out_: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    cu_seqlens_k_new: torch.Tensor | None = None,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    page_table: torch.Tensor | None = None,
    kv_batch_idx: torch.Tensor | None = None,
    leftpad_k: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    seqlens_rotary: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size_left: int = -1,
    window_size_right: int = -1,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    scheduler_metadata: torch.Tensor | None = None,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    sm_margin: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if cu_seqlens_q is not None:
        total_q, num_heads, _ = q.shape
        out = torch.empty((total_q, num_heads, v.shape[-1]), dtype=q.dtype, device=q.device)
        softmax_lse = torch.empty((num_heads, total_q), dtype=torch.float32, device=q.device)
    else:
        batch_size, seqlen_q, num_heads, _ = q.shape
        out = torch.empty((batch_size, seqlen_q, num_heads, v.shape[-1]), dtype=q.dtype, device=q.device)
        softmax_lse = torch.empty((batch_size, num_heads, seqlen_q), dtype=torch.float32, device=q.device)
    return out, softmax_lse, torch.tensor([], device=q.device), torch.tensor([], device=q.device)


@torch.library.custom_op(
    "flash_attn_3::_flash_attn_backward", mutates_args=("dq", "dk", "dv"), device_types=_DEVICE_TYPES
)
def _flash_attn_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    sequed_q: torch.Tensor | None = None,
    sequed_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    is_causal: bool = False,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    deterministic: bool = False,
    sm_margin: int = 0,
) -> torch.Tensor:
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    varlen_q, varlen_k = cu_seqlens_q is not None, cu_seqlens_k is not None
    batch_size = cu_seqlens_q.numel() - 1 if varlen_q else q.shape[0]
    qsegs = _segments(q, cu_seqlens_q, sequed_q, batch_size)
    ksegs = _segments(k, cu_seqlens_k, sequed_k, batch_size)
    for x in (dq, dk, dv):
        if x is not None:
            x.zero_()
    num_heads = q.shape[-2]
    if varlen_q:
        softmax_d = torch.zeros(
            (num_heads, round_multiple(q.shape[0] + batch_size * 128, 128)), device=q.device
        )
    else:
        softmax_d = torch.zeros((batch_size, num_heads, round_multiple(q.shape[1], 128)), device=q.device)
    cd = compute_dtype(q.dtype)
    for b in range(batch_size):
        (q0, nq), (k0, nk) = qsegs[b], ksegs[b]
        gq, gk, gv, d = attention_backward(
            _rows(dout, varlen_q, q0, nq).transpose(1, 2).to(cd),
            _rows(q, varlen_q, q0, nq).transpose(1, 2).to(cd),
            _rows(k, varlen_k, k0, nk).transpose(1, 2).to(cd),
            _rows(v, varlen_k, k0, nk).transpose(1, 2).to(cd),
            scale=softmax_scale,
            allowed=_doc_allowed(nq, nk, is_causal, window_size_left, window_size_right, 0, q.device),
            softcap=softcap,
        )
        for dst, g, varlen, start, n in (
            (dq, gq, varlen_q, q0, nq),
            (dk, gk, varlen_k, k0, nk),
            (dv, gv, varlen_k, k0, nk),
        ):
            if dst is None:
                continue
            g = g[0].transpose(0, 1).to(dst.dtype)
            if varlen:
                dst[start : start + n] = g
            else:
                dst[start, :n] = g
        if varlen_q:
            softmax_d[:, q0 : q0 + nq] = d[0]
        else:
            softmax_d[b, :, :nq] = d[0]
    return softmax_d


@torch.library.register_fake("flash_attn_3::_flash_attn_backward")
def _flash_attn_backward_fake(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    sequed_q: torch.Tensor | None = None,
    sequed_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    is_causal: bool = False,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    deterministic: bool = False,
    sm_margin: int = 0,
) -> torch.Tensor:
    num_heads = q.shape[-2]
    if cu_seqlens_q is not None:
        batch_size = cu_seqlens_q.numel() - 1
        return torch.empty((num_heads, round_multiple(q.shape[0] + batch_size * 128, 128)), device=q.device)
    return torch.empty((q.shape[0], num_heads, round_multiple(q.shape[1], 128)), device=q.device)


def setup_context(ctx, inputs, output):
    q, k, v = inputs[:3]
    out, softmax_lse, _, _ = output
    ctx.save_for_backward(q, k, v, out, softmax_lse, inputs[7], inputs[8], inputs[10], inputs[11])
    ctx.max_seqlen_q, ctx.max_seqlen_k = inputs[12], inputs[13]
    ctx.softmax_scale = inputs[-11]
    ctx.causal = inputs[-10]
    ctx.window_size = [inputs[-9], inputs[-8]]
    ctx.attention_chunk = inputs[-7]
    ctx.softcap = inputs[-6]
    ctx.sm_margin = inputs[-1]


def _backward(ctx, dout, *grads):
    q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = ctx.saved_tensors
    assert ctx.attention_chunk == 0, "FA3 backward does not support attention_chunk"
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_attn_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        cu_seqlens_q,
        cu_seqlens_k,
        seqused_q,
        seqused_k,
        ctx.max_seqlen_q,
        ctx.max_seqlen_k,
        dq,
        dk,
        dv,
        ctx.softmax_scale,
        ctx.causal,
        ctx.window_size[0],
        ctx.window_size[1],
        ctx.softcap,
        False,  # deterministic
        ctx.sm_margin,
    )
    return dq, dk, dv, *((None,) * 31)


_flash_attn_forward.register_autograd(_backward, setup_context=setup_context)


class FlashAttnQKVPackedFunc(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        qkv,
        softmax_scale,
        causal,
        q_descale=None,
        k_descale=None,
        v_descale=None,
        window_size=(-1, -1),
        attention_chunk=0,
        softcap=0.0,
        deterministic=False,
        num_heads_q=None,
        sm_margin=0,
        return_softmax=False,
    ):
        if softmax_scale is None:
            softmax_scale = qkv.shape[-1] ** (-0.5)
        if qkv.dim() == 5:
            assert qkv.shape[-3] == 3
            q, k, v = qkv.unbind(dim=-3)
        else:
            assert qkv.dim() == 4
            assert num_heads_q is not None
            num_heads_k = (qkv.shape[2] - num_heads_q) // 2
            assert num_heads_k * 2 + num_heads_q == qkv.shape[2]
            q, k, v = qkv.split([num_heads_q, num_heads_k, num_heads_k], dim=-2)
        out, softmax_lse, *rest = _flash_attn_forward(
            q,
            k,
            v,
            None,
            None,  # k_new, v_new
            None,  # qv
            None,  # out
            None,
            None,
            None,  # cu_seqlens_q/k/k_new
            None,
            None,  # seqused_q/k
            None,
            None,  # max_seqlen_q/k
            None,
            None,
            None,  # page_table, kv_batch_idx, leftpad_k,
            None,
            None,
            None,  # rotary_cos/sin, seqlens_rotary
            q_descale,
            k_descale,
            v_descale,
            softmax_scale,
            causal=causal,
            window_size_left=window_size[0],
            window_size_right=window_size[1],
            attention_chunk=attention_chunk,
            softcap=softcap,
            sm_margin=sm_margin,
        )
        ctx.save_for_backward(q, k, v, out, softmax_lse)
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.window_size = window_size
        ctx.attention_chunk = attention_chunk
        ctx.softcap = softcap
        ctx.deterministic = deterministic
        ctx.ndim = qkv.dim()
        ctx.sm_margin = sm_margin
        return (out, softmax_lse) if return_softmax else out

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse = ctx.saved_tensors
        assert ctx.attention_chunk == 0, "FA3 backward does not support attention_chunk"
        if ctx.ndim == 5:
            qkv_shape = q.shape[:-2] + (3, *q.shape[-2:])
            dqkv = torch.empty(qkv_shape, dtype=q.dtype, device=q.device)
            dq, dk, dv = dqkv.unbind(dim=-3)
        else:
            num_heads_q = q.shape[2]
            num_heads_k = k.shape[2]
            qkv_shape = q.shape[:-2] + (num_heads_q + num_heads_k * 2, *q.shape[-1:])
            dqkv = torch.empty(qkv_shape, dtype=q.dtype, device=q.device)
            dq, dk, dv = dqkv.split([num_heads_q, num_heads_k, num_heads_k], dim=-2)
        _flash_attn_backward(
            dout,
            q,
            k,
            v,
            out,
            softmax_lse,
            None,
            None,  # cu_seqlens_q, cu_seqlens_k,
            None,
            None,  # sequed_q, sequed_k,
            None,
            None,  # max_seqlen_q, max_seqlen_k,
            dq,
            dk,
            dv,
            ctx.softmax_scale,
            ctx.causal,
            ctx.window_size[0],
            ctx.window_size[1],
            ctx.softcap,
            ctx.deterministic,
            ctx.sm_margin,
        )
        dqkv = dqkv[..., : dout.shape[-1]]  # We could have padded the head dimension
        return dqkv, None, None, None, None, None, None, None, None, None, None, None, None


class FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        softmax_scale,
        causal,
        qv=None,
        q_descale=None,
        k_descale=None,
        v_descale=None,
        window_size=(-1, -1),
        attention_chunk=0,
        softcap=0.0,
        num_splits=1,
        pack_gqa=None,
        deterministic=False,
        sm_margin=0,
        return_softmax=False,
    ):
        if softmax_scale is None:
            softmax_scale = (q.shape[-1] + (qv.shape[-1] if qv is not None else 0)) ** (-0.5)
        out, softmax_lse, *rest = _flash_attn_forward(
            q,
            k,
            v,
            None,
            None,  # k_new, v_new
            qv,  # qv
            None,  # out
            None,
            None,
            None,  # cu_seqlens_q/k/k_new
            None,
            None,  # seqused_q/k
            None,
            None,  # max_seqlen_q/k
            None,
            None,
            None,  # page_table, kv_batch_idx, leftpad_k,
            None,
            None,
            None,  # rotary_cos/sin, seqlens_rotary
            q_descale,
            k_descale,
            v_descale,
            softmax_scale,
            causal=causal,
            window_size_left=window_size[0],
            window_size_right=window_size[1],
            attention_chunk=attention_chunk,
            softcap=softcap,
            num_splits=num_splits,
            pack_gqa=pack_gqa,
            sm_margin=sm_margin,
        )
        ctx.save_for_backward(q, k, v, out, softmax_lse)
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.window_size = window_size
        ctx.attention_chunk = attention_chunk
        ctx.softcap = softcap
        ctx.deterministic = deterministic
        ctx.sm_margin = sm_margin
        return (out, softmax_lse) if return_softmax else out

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse = ctx.saved_tensors
        assert ctx.attention_chunk == 0, "FA3 backward does not support attention_chunk"
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(
            dout,
            q,
            k,
            v,
            out,
            softmax_lse,
            None,
            None,  # cu_seqlens_q, cu_seqlens_k,
            None,
            None,  # sequed_q, sequed_k,
            None,
            None,  # max_seqlen_q, max_seqlen_k,
            dq,
            dk,
            dv,
            ctx.softmax_scale,
            ctx.causal,
            ctx.window_size[0],
            ctx.window_size[1],
            ctx.softcap,
            ctx.deterministic,
            ctx.sm_margin,
        )
        dq = dq[..., : q.shape[-1]]  # We could have padded the head dimension
        dk = dk[..., : k.shape[-1]]
        dv = dv[..., : v.shape[-1]]
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None, None, None, None


class FlashAttnVarlenFunc(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        seqused_q,
        seqused_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        causal,
        qv=None,
        q_descale=None,
        k_descale=None,
        v_descale=None,
        window_size=(-1, -1),
        attention_chunk=0,
        softcap=0.0,
        num_splits=1,
        pack_gqa=None,
        deterministic=False,
        sm_margin=0,
        return_softmax=False,
    ):
        if softmax_scale is None:
            softmax_scale = (q.shape[-1] + (qv.shape[-1] if qv is not None else 0)) ** (-0.5)
        out, softmax_lse, *rest = _flash_attn_forward(
            q,
            k,
            v,
            None,
            None,  # k_new, v_new
            qv,  # qv
            None,  # out
            cu_seqlens_q,
            cu_seqlens_k,
            None,  # cu_seqlens_k_new
            seqused_q,
            seqused_k,
            max_seqlen_q,
            max_seqlen_k,
            None,
            None,
            None,  # page_table, kv_batch_idx, leftpad_k,
            None,
            None,
            None,  # rotary_cos/sin, seqlens_rotary
            q_descale,
            k_descale,
            v_descale,
            softmax_scale,
            causal=causal,
            window_size_left=window_size[0],
            window_size_right=window_size[1],
            attention_chunk=attention_chunk,
            softcap=softcap,
            num_splits=num_splits,
            pack_gqa=pack_gqa,
            sm_margin=sm_margin,
        )
        ctx.save_for_backward(q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        ctx.max_seqlen_q = max_seqlen_q
        ctx.max_seqlen_k = max_seqlen_k
        ctx.softmax_scale = softmax_scale
        ctx.causal = causal
        ctx.window_size = window_size
        ctx.attention_chunk = attention_chunk
        ctx.softcap = softcap
        ctx.deterministic = deterministic
        ctx.sm_margin = sm_margin
        return (out, softmax_lse) if return_softmax else out

    @staticmethod
    def backward(ctx, dout, *args):
        q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = ctx.saved_tensors
        assert ctx.attention_chunk == 0, "FA3 backward does not support attention_chunk"
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _flash_attn_backward(
            dout,
            q,
            k,
            v,
            out,
            softmax_lse,
            cu_seqlens_q,
            cu_seqlens_k,
            seqused_q,
            seqused_k,
            ctx.max_seqlen_q,
            ctx.max_seqlen_k,
            dq,
            dk,
            dv,
            ctx.softmax_scale,
            ctx.causal,
            ctx.window_size[0],
            ctx.window_size[1],
            ctx.softcap,
            ctx.deterministic,
            ctx.sm_margin,
        )
        dq = dq[..., : q.shape[-1]]  # We could have padded the head dimension
        dk = dk[..., : k.shape[-1]]
        dv = dv[..., : v.shape[-1]]
        return (dq, dk, dv, *((None,) * 20))


def flash_attn_qkvpacked_func(
    qkv,
    softmax_scale=None,
    causal=False,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    deterministic=False,
    num_heads_q=None,
    sm_margin=0,
    return_attn_probs=False,
):
    """qkv: (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, nheads_q + 2·nheads_k, headdim) with num_heads_q."""
    return FlashAttnQKVPackedFunc.apply(
        qkv,
        softmax_scale,
        causal,
        q_descale,
        k_descale,
        v_descale,
        window_size,
        attention_chunk,
        softcap,
        deterministic,
        num_heads_q,
        sm_margin,
        return_attn_probs,
    )


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    """q: (batch, seqlen_q, nheads, headdim), k/v: (batch, seqlen_k, nheads_k, headdim); see module docstring."""
    return FlashAttnFunc.apply(
        q,
        k,
        v,
        softmax_scale,
        causal,
        qv,
        q_descale,
        k_descale,
        v_descale,
        window_size,
        attention_chunk,
        softcap,
        num_splits,
        pack_gqa,
        deterministic,
        sm_margin,
        return_attn_probs,
    )


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    """q: (total_q, nheads, headdim), k/v: (total_k, nheads_k, headdim), cu_seqlens_*: (batch + 1,) int32."""
    return FlashAttnVarlenFunc.apply(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        seqused_q,
        seqused_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale,
        causal,
        qv,
        q_descale,
        k_descale,
        v_descale,
        window_size,
        attention_chunk,
        softcap,
        num_splits,
        pack_gqa,
        deterministic,
        sm_margin,
        return_attn_probs,
    )


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    page_table: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k_new: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    rotary_seqlens: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),  # -1 means infinite context window
    attention_chunk=0,
    softcap=0.0,  # 0.0 means deactivated
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,  # Can be tuned for speed
    pack_gqa=None,  # Can be tuned for speed
    sm_margin=0,  # Can be tuned if some SMs are used for communication
    return_softmax_lse=False,
):
    """Inference entry point, calling the op as the real one does (cache_seqlens -> seqused_k).

    Appending new k/v (``k``, ``v``), paging, rotary and leftpad raise NotImplementedError in the stand-in.
    """
    if softmax_scale is None:
        softmax_scale = (q.shape[-1] + (qv.shape[-1] if qv is not None else 0)) ** (-0.5)
    if cache_seqlens is not None and isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=k_cache.device)
        cache_seqlens = maybe_contiguous(cache_seqlens)
    out, softmax_lse, *rest = _flash_attn_forward(
        q,
        k_cache,
        v_cache,
        k,
        v,
        qv,
        None,  # out
        cu_seqlens_q,
        None,  # cu_seqlens_k
        cu_seqlens_k_new,
        None,  # seqused_q
        cache_seqlens,
        max_seqlen_q,
        None,  # max_seqlen_k
        page_table,
        cache_batch_idx,
        cache_leftpad,
        rotary_cos,
        rotary_sin,
        rotary_seqlens,
        q_descale,
        k_descale,
        v_descale,
        softmax_scale,
        causal=causal,
        window_size_left=window_size[0],
        window_size_right=window_size[1],
        attention_chunk=attention_chunk,
        softcap=softcap,
        rotary_interleaved=rotary_interleaved,
        scheduler_metadata=scheduler_metadata,
        num_splits=num_splits,
        pack_gqa=pack_gqa,
        sm_margin=sm_margin,
    )
    return (out, softmax_lse, *rest) if return_softmax_lse else out
