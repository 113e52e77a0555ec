"""Shared pure-PyTorch attention math for the stand-in packages next to this file (test code, not a real library).

The flash-attn 2/3, xformers and Transformer Engine stand-ins compute attention here. Everything is
plain differentiable torch with an explicit softmax made of exp/sum (never ``torch.softmax``,
``F.softmax`` or ``F.scaled_dot_product_attention``), so an interceptor of those calls never sees the
stand-ins' insides as extra attention calls.

Layout here is (batch, heads, seq, head_dim). Conventions shared by every stand-in:

- ``allowed`` is a bool tensor broadcastable to (B, H, Sq, Sk), True = the query may attend the key.
- ``bias`` is an additive float tensor broadcastable to (B, H, Sq, Sk); -inf entries block the key.
- a query row with no allowed key (and no sink) gets probability 0 everywhere and a zero output
  (flash-attn's documented behaviour); its log-sum-exp is -inf here, callers adjust it to their library.
- GQA/MQA: k/v may have fewer heads; query head h reads kv head h // (H // Hkv).
"""

from __future__ import annotations

import math

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Kernels accumulate in fp32; keep fp64 inputs in fp64 so tests can compare tightly."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def window_mask(
    seqlen_q: int,
    seqlen_k: int,
    *,
    offset: int,
    causal: bool = False,
    window_left: int = -1,
    window_right: int = -1,
    chunk: int = 0,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Bool (seqlen_q, seqlen_k): query i may see key j.

    With ``d = i + offset`` (offset = seqlen_k - seqlen_q for bottom-right alignment, 0 for top-left):
    causal keeps j <= d; window keeps d - window_left <= j <= d + window_right (-1 = unbounded side);
    chunk > 0 keeps j in [floor(d / chunk) * chunk, floor(d / chunk) * chunk + chunk). All intersect.
    """
    d = torch.arange(seqlen_q, device=device).unsqueeze(1) + offset
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if causal:
        allowed &= j <= d
    if window_left >= 0:
        allowed &= j >= d - window_left
    if window_right >= 0:
        allowed &= j <= d + window_right
    if chunk > 0:
        start = torch.div(d, chunk, rounding_mode="floor") * chunk
        allowed &= (j >= start) & (j < start + chunk)
    return allowed


def alibi_bias(
    seqlen_q: int, seqlen_k: int, slopes: torch.Tensor, *, offset: int, dtype: torch.dtype
) -> torch.Tensor:
    """-slope * |i + offset - j|; slopes (H,) -> (1, H, Sq, Sk), (B, H) -> (B, H, Sq, Sk)."""
    d = torch.arange(seqlen_q, device=slopes.device).unsqueeze(1) + offset
    j = torch.arange(seqlen_k, device=slopes.device).unsqueeze(0)
    dist = (d - j).abs().to(dtype)
    s = slopes.to(dtype)
    if s.dim() == 1:
        s = s.unsqueeze(0)
    return -s[:, :, None, None] * dist


def expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(B, Hkv, S, D) -> (B, H, S, D), head h reading kv head h // (H // Hkv)."""
    hkv = x.shape[1]
    if hkv == num_heads:
        return x
    if num_heads % hkv:
        raise ValueError(f"number of query heads ({num_heads}) must be divisible by kv heads ({hkv})")
    return x.repeat_interleave(num_heads // hkv, dim=1)


def reduce_kv_grad(g: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Inverse of expand_kv for gradients: sum the query heads that share a kv head."""
    b, h, s, d = g.shape
    if h == num_kv_heads:
        return g
    return g.reshape(b, num_kv_heads, h // num_kv_heads, s, d).sum(2)


def scores(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float,
    allowed: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    softcap: float = 0.0,
    pre_scale_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Masked softmax input (B, H, Sq, Sk): cap·tanh(q·k·scale / cap) (if softcap > 0) + bias, -inf where blocked.

    ``pre_scale_bias`` (Transformer Engine's "pre_scale_bias") is added before the scale: (q·k + b)·scale.
    """
    s = q @ k.transpose(-2, -1)
    if pre_scale_bias is not None:
        s = s + pre_scale_bias
    s = s * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    return s


def softmax_rows(s: torch.Tensor, sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities over the last dim and log-sum-exp, from exp/sum only (no torch.softmax).

    ``sink`` (H,) is one extra logit per head that joins every row's denominator (attention sinks,
    GPT-OSS / TE "learnable" softmax) but has no value. Rows whose entries are all -inf (and have no
    sink) get all-zero probabilities and lse = -inf; the gradient stays finite.
    """
    m = s.amax(dim=-1, keepdim=True)
    if sink is not None:
        m = torch.maximum(m, sink.to(s.dtype)[None, :, None, None])
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(s - m)
    denom = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink.to(s.dtype)[None, :, None, None] - m)
    empty = denom == 0
    safe = torch.where(empty, torch.ones_like(denom), denom)
    p = e / safe
    lse = torch.where(empty, torch.full_like(denom, -math.inf), m + torch.log(safe)).squeeze(-1)
    return p, lse


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    allowed: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    softcap: float = 0.0,
    sink: torch.Tensor | None = None,
    pre_scale_bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Differentiable attention in (B, H, S, D) layout, in q's dtype. Returns (out, lse, probs).

    GQA by expanding k/v. Dropout (if any) is torch's ordinary dropout on the probabilities.
    """
    h = q.shape[1]
    k = expand_kv(k, h)
    v = expand_kv(v, h)
    s = scores(q, k, scale=scale, allowed=allowed, bias=bias, softcap=softcap, pre_scale_bias=pre_scale_bias)
    p, lse = softmax_rows(s, sink)
    pd = torch.nn.functional.dropout(p, dropout_p, training=True) if dropout_p > 0 else p
    return pd @ v, lse, p


def attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    allowed: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Closed-form gradients of ``attention`` (no dropout, no sink) for the custom backward ops.

    Autograd is not available inside a torch custom op's implementation, so the flash-attn
    stand-ins' ``_flash_attn_backward`` ops use this, as the real kernels do:
    P = softmax(S); dV = Pᵀ dO; dP = dO Vᵀ; D = rowsum(dO ∘ O); dS = P ∘ (dP − D), times 1 − tanh² under
    softcap; dQ = dS K · scale; dK = dSᵀ Q · scale; kv-head gradients summed over their query heads.
    Returns (dq, dk, dv, D) with D of shape (B, H, Sq).
    """
    h, hkv = q.shape[1], k.shape[1]
    ke, ve = expand_kv(k, h), expand_kv(v, h)
    s = (q @ ke.transpose(-2, -1)) * scale
    t = None
    if softcap > 0:
        t = torch.tanh(s / softcap)
        s = softcap * t
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = s.masked_fill(~allowed, -math.inf)
    p, _ = softmax_rows(s)
    out = p @ ve
    dv = p.transpose(-2, -1) @ dout
    dp = dout @ ve.transpose(-2, -1)
    d = (dout * out).sum(-1, keepdim=True)
    ds = p * (dp - d)
    if t is not None:
        ds = ds * (1 - t * t)
    dq = (ds @ ke) * scale
    dk = (ds.transpose(-2, -1) @ q) * scale
    return dq, reduce_kv_grad(dk, hkv), reduce_kv_grad(dv, hkv), d.squeeze(-1)
