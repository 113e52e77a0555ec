"""Building blocks of the reference GPT: norms, RoPE, attention, MLP.

These run inside the model's forward pass; they are plain modules with no stabkit hooks.
"""

from __future__ import annotations

import contextlib
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ...discovery.families import STABKIT_GPT
from ...layers import RMSNorm
from .config import GPTConfig


def make_norm(cfg: GPTConfig, dim: int | None = None) -> nn.Module:
    """A norm of the kind `cfg.norm` over the last `dim` (default d_model) features."""
    width = dim or cfg.d_model
    if cfg.norm == "rmsnorm":
        return RMSNorm(width, cfg.norm_eps)
    return nn.LayerNorm(width, eps=cfg.norm_eps, bias=cfg.bias)


def rope_tables(head_dim: int, length: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables for rotary embeddings, each (length, head_dim/2), float32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)  # (T, hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :hd/2], x[..., hd/2:]) of x (B, H, T, hd) by the position angles."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos_t = cos[: x.shape[-2]].to(x.dtype)  # (T, hd/2)
    sin_t = sin[: x.shape[-2]].to(x.dtype)
    return torch.cat((x1 * cos_t - x2 * sin_t, x1 * sin_t + x2 * cos_t), dim=-1)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap · tanh(x / cap): smooth, bounded by ±cap, identity near zero."""
    return cap * torch.tanh(x / cap)


class Attention(nn.Module):
    """Causal self-attention with separate q/k/v projections, optional GQA, QK-norm, RoPE, soft cap.

    Two paths: fused SDPA (``cfg.attention = "sdpa"``), or eager attention (`eager_attention`:
    logits materialised, masked, softmaxed) for ``"eager"``, a soft cap or an fp32 softmax.
    """

    stabkit_family: ClassVar[str] = STABKIT_GPT
    """Declares the family to stabkit (`stabkit.discovery.families`): the interventions fill the
    ``q_norm``/``k_norm`` slots and read ``softcap``, without importing this class."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.softcap = cfg.attn_softcap
        self.softmax_fp32 = cfg.softmax_fp32
        self.eager = cfg.attention == "eager" or cfg.attn_softcap is not None or cfg.softmax_fp32
        self.q_proj = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.bias)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv_heads * cfg.head_dim, bias=cfg.bias)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv_heads * cfg.head_dim, bias=cfg.bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.bias)
        self.q_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = make_norm(cfg, cfg.head_dim) if cfg.qk_norm else None
        self.use_rope = cfg.positions == "rope"
        if self.use_rope:
            cos, sin = rope_tables(cfg.head_dim, cfg.context, cfg.rope_base)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q = self.q_proj(x).view(bsz, seq, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k_proj(x).view(bsz, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, hd)
        v = self.v_proj(x).view(bsz, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            cos, sin = self.get_buffer("rope_cos"), self.get_buffer("rope_sin")
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        drop = self.dropout if self.training else 0.0
        if self.eager:
            y = eager_attention(q, k, v, drop, cap=self.softcap, fp32=self.softmax_fp32)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=drop, enable_gqa=self.n_kv_heads != self.n_heads
            )
        y = y.transpose(1, 2).reshape(bsz, seq, self.n_heads * self.head_dim)  # (B, T, d)
        return self.o_proj(y)


def eager_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    drop: float = 0.0,
    *,
    cap: float | None = None,
    fp32: bool = False,
) -> torch.Tensor:
    """Causal attention with the logits materialised: (q @ kᵀ)·scale, [soft cap], mask, softmax, @ v.

    Runs in the attention module's forward. As Hugging Face's eager attention: the product is taken
    before the scale, in the autocast dtype (fp16 under fp16 autocast, where |q·k| > 65504 is Inf; on
    a CPU autocast also leaves the softmax in fp16/bf16). `fp32`: logits and softmax in float32 with
    autocast off, the weights cast back to v's dtype. q (B, H, T, hd); k, v (B, Hkv, T, hd).
    """
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # (B, H, T, hd)
    seq, scale = q.shape[-2], q.shape[-1] ** -0.5
    off = torch.autocast(q.device.type, enabled=False) if fp32 else contextlib.nullcontext()
    with off:
        if fp32:
            q, k = q.float(), k.float()
        logits = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, T)
        if cap is not None:
            logits = softcap(logits, cap)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
        logits = logits.masked_fill(~causal, float("-inf"))
        weights = torch.softmax(logits, dim=-1)  # (B, H, T, T)
    if fp32:
        weights = weights.to(v.dtype)  # v: the autocast dtype, or the parameters' (no autocast)
    weights = F.dropout(weights, p=drop, training=drop > 0)
    return weights @ v


class MLP(nn.Module):
    """GELU MLP (fc → gelu → proj) or SwiGLU (silu(gate) · fc → proj)."""

    def __init__(self, cfg: GPTConfig, width: int | None = None) -> None:
        super().__init__()
        hidden = width or cfg.ff_width
        self.gated = cfg.mlp == "swiglu"
        self.fc = nn.Linear(cfg.d_model, hidden, bias=cfg.bias)
        self.gate = nn.Linear(cfg.d_model, hidden, bias=cfg.bias) if self.gated else None
        self.proj = nn.Linear(hidden, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate is not None:
            return self.proj(F.silu(self.gate(x)) * self.fc(x))
        return self.proj(F.gelu(self.fc(x)))
