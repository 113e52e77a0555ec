"""Hand-written GPTs whose attention hides in places a model walker has to look for.

Each is a 2-layer causal LM (d=32, 4 heads, vocab 96) making 2 attention calls per forward:

- ``inline``: attention written INLINE in the block's forward (fused qkv Linear -> SDPA), no attention module;
- ``moduledict``: blocks held in an ``nn.ModuleDict``;
- ``interleaved``: one flat layer list ``[attn, ff, attn, ff]`` of residual sub-layers;
- ``attention-block``: a whole block class named ``AttentionBlock`` (attention via ``nn.MultiheadAttention``);
- ``token-mixer``: the attention module is ``block.mixer`` of class ``TokenMixer``;
- ``eager-interleaved-qkv``: softmax(q @ kᵀ * scale) by hand, fused qkv laid out per head ``[q_h k_h v_h]``;
- ``gqa-rope``: separate q/k/v Linears, 4 query / 2 kv heads, RoPE applied before ``SDPA(enable_gqa=True)``;
- ``tied-logit-scale``: unembedding ``x @ self.wte.weight.T`` (no head Linear), then ``logits * self.logit_scale``;
- ``child-sdpa``: LLaMA-style; SDPA called by a parameter-free child module of the attention that returns
  (B, T, H, hd), reshaped to (B, T, H·hd) and projected by ``o_proj`` only in the attention's forward;
- ``nanogpt-layernorm-class``: nanoGPT as written, with its own ``LayerNorm`` class (``weight`` and ``bias``,
  ``F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)``, no ``normalized_shape`` or ``eps``);
- ``hybrid-conv``: a hybrid ``[conv, attn, conv, attn]`` layer list: pre-norm blocks whose token mixer is a
  causal depthwise conv1d + Linear beside pre-norm attention blocks, each with an MLP (2 attention calls).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .base import SEQ, VOCAB, ZooModel, finish, token_ce, tokens

BUILDERS: dict[str, Callable[[], ZooModel]] = {}
DIM, HEADS, LAYERS = 32, 4, 2
HEAD_DIM = DIM // HEADS


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))


def split_heads(x: torch.Tensor, heads: int = HEADS) -> torch.Tensor:
    """(B, T, heads * hd) -> (B, heads, T, hd)."""
    b, t, _ = x.shape
    return x.view(b, t, heads, -1).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, hd) -> (B, T, H * hd)."""
    b, h, t, d = x.shape
    return x.transpose(1, 2).reshape(b, t, h * d)


class SelfAttention(nn.Module):
    """Fused qkv (contiguous q | k | v), causal SDPA, output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(t) for t in self.qkv(x).split(DIM, dim=-1))
        return self.proj(merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


class GPTBase(nn.Module):
    """Token + learned position embeddings, `self.body(x)`, final LayerNorm, Linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(SEQ, DIM)
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln_f(self.body(x)))


# (a) attention inline in the block's forward ------------------------------------------------------


class InlineBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(DIM)
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)
        self.ln_2 = nn.LayerNorm(DIM)
        self.mlp = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(self.ln_1(x)).split(DIM, dim=-1)
        y = F.scaled_dot_product_attention(split_heads(q), split_heads(k), split_heads(v), is_causal=True)
        x = x + self.c_proj(merge_heads(y))
        return x + self.mlp(self.ln_2(x))


class InlineGPT(GPTBase):
    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList(InlineBlock() for _ in range(LAYERS))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.h:
            x = block(x)
        return x


# (b) blocks in an nn.ModuleDict --------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = SelfAttention()
        self.norm2 = nn.LayerNorm(DIM)
        self.ff = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class ModuleDictGPT(GPTBase):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({f"layer_{i}": Block() for i in range(LAYERS)})

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for name in sorted(self.blocks):
            x = self.blocks[name](x)
        return x


# (c) one layer list interleaving attention and feed-forward: [attn, ff, attn, ff] ----------------


class PreNormResidual(nn.Module):
    def __init__(self, fn: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fn(self.norm(x))


class InterleavedGPT(GPTBase):
    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(LAYERS):
            layers += [PreNormResidual(SelfAttention()), PreNormResidual(mlp())]
        self.layers = nn.ModuleList(layers)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# (d) a whole block whose class name says "Attention" (attention itself: nn.MultiheadAttention) --------


class AttentionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(DIM)
        self.self_attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.ln_mlp = nn.LayerNorm(DIM)
        self.mlp = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)  # True = may NOT attend
        h = self.ln_attn(x)
        x = x + self.self_attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.ln_mlp(x))


class AttentionBlockGPT(GPTBase):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(AttentionBlock() for _ in range(LAYERS))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


# (e) the attention module is `mixer`, of class TokenMixer --------------------------------------------


class TokenMixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out_proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(t) for t in self.in_proj(x).chunk(3, dim=-1))
        return self.out_proj(merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


class MixerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(DIM)
        self.mixer = TokenMixer()
        self.norm_ff = nn.RMSNorm(DIM)
        self.channel_mlp = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.norm(x))
        return x + self.channel_mlp(self.norm_ff(x))


class MixerGPT(GPTBase):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(*(MixerBlock() for _ in range(LAYERS)))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)


# (f) eager attention by hand with an interleaved-per-head fused qkv ([q_h k_h v_h] per head) ----------


class EagerInterleavedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query_key_value = nn.Linear(DIM, 3 * DIM)
        self.dense = nn.Linear(DIM, DIM)
        self.scale = 1.0 / math.sqrt(HEAD_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.query_key_value(x).view(b, t, HEADS, 3 * HEAD_DIM).transpose(1, 2)  # (B, H, T, 3hd)
        q, k, v = qkv.split(HEAD_DIM, dim=-1)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        weights = scores.softmax(dim=-1)
        return self.dense(merge_heads(weights @ v))


class EagerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(DIM)
        self.attention = EagerInterleavedAttention()
        self.post_attention_layernorm = nn.LayerNorm(DIM)
        self.mlp = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class EagerGPT(GPTBase):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EagerBlock() for _ in range(LAYERS))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# (g) GQA: separate q/k/v Linears, RoPE on q and k before the SDPA call -------------------------------

KV_HEADS = 2


def rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary embedding (rotate-half convention) of (B, H, T, hd)."""
    t, d = x.shape[-2], x.shape[-1]
    inv_freq = base ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = torch.arange(t, dtype=torch.float32, device=x.device)[:, None] * inv_freq  # (T, hd/2)
    cos, sin = torch.cat([angles, angles], dim=-1).cos(), torch.cat([angles, angles], dim=-1).sin()
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class GQAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = rope(split_heads(self.q_proj(x), HEADS))
        k = rope(split_heads(self.k_proj(x), KV_HEADS))
        v = split_heads(self.v_proj(x), KV_HEADS)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(merge_heads(y))


class LlamaishBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.self_attn = GQAttention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GQAGPT(nn.Module):
    """No position embedding table: positions come from RoPE only."""

    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(LlamaishBlock() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


# (h) tied unembedding by matmul with the embedding table, then a logit scale ----------------------------


class TiedScaledGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(DIM)
        self.logit_scale = nn.Parameter(torch.tensor(1.0 / math.sqrt(DIM)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.wte.weight.T
        return logits * self.logit_scale


# (i) LLaMA-style, SDPA called through a parameter-free child module returning (B, T, H, hd) ------------


class ScaledDotProductAttention(nn.Module):
    """F.scaled_dot_product_attention as a module: (B, H, T, hd) q, k, v -> (B, T, H, hd)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


class ChildSDPAAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.k_proj = nn.Linear(DIM, DIM, bias=False)
        self.v_proj = nn.Linear(DIM, DIM, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)
        self.sdpa = ScaledDotProductAttention()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k = rope(split_heads(self.q_proj(x))), rope(split_heads(self.k_proj(x)))
        y = self.sdpa(q, k, split_heads(self.v_proj(x)))  # (B, T, H, hd): not the sub-layer output
        return self.o_proj(y.reshape(b, t, DIM))


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(DIM, 2 * DIM, bias=False)
        self.up_proj = nn.Linear(DIM, 2 * DIM, bias=False)
        self.down_proj = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ChildSDPABlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(DIM, eps=1e-6)
        self.self_attn = ChildSDPAAttention()
        self.post_attention_layernorm = nn.RMSNorm(DIM, eps=1e-6)
        self.mlp = SwiGLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class ChildSDPAGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(ChildSDPABlock() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM, eps=1e-6)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


# (j) nanoGPT as written: its own LayerNorm class (weight + optional bias, eps 1e-5 in the forward) ----


class LayerNorm(nn.Module):
    """nanoGPT's LayerNorm with an optional bias (PyTorch's had none before 2.1)."""

    def __init__(self, ndim: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)
        self.attn_dropout = nn.Dropout(0.0)
        self.resid_dropout = nn.Dropout(0.0)
        self.n_head, self.n_embd, self.dropout = HEADS, DIM, 0.0
        self.flash = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class NanoMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(DIM, 4 * DIM)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * DIM, DIM)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class NanoBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(DIM, bias=True)
        self.attn = CausalSelfAttention()
        self.ln_2 = LayerNorm(DIM, bias=True)
        self.mlp = NanoMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPTOwnLayerNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, DIM),
                wpe=nn.Embedding(SEQ, DIM),
                drop=nn.Dropout(0.0),
                h=nn.ModuleList(NanoBlock() for _ in range(LAYERS)),
                ln_f=LayerNorm(DIM, bias=True),
            )
        )
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        pos = torch.arange(0, idx.shape[1], dtype=torch.long, device=idx.device)
        x = t.drop(t.wte(idx) + t.wpe(pos))
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))


# (k) hybrid: pre-norm blocks mixing tokens by a causal depthwise conv1d beside attention blocks ------


class CausalConvMixer(nn.Module):
    """Short causal depthwise convolution over time (kernel 4), SiLU, output Linear (LFM2 / Hyena-like)."""

    def __init__(self, kernel: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv1d(DIM, DIM, kernel, groups=DIM, padding=kernel - 1)
        self.out_proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        y = self.conv(x.transpose(1, 2))[..., :t].transpose(1, 2)  # left padding only: causal
        return self.out_proj(F.silu(y))


class ConvBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.mixer = CausalConvMixer()
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class HybridConvGPT(GPTBase):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ConvBlock(), Block(), ConvBlock(), Block()])

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _register(name: str, make: Callable[[], nn.Module], notes: str, calls: int = LAYERS) -> None:
    def build() -> ZooModel:
        torch.manual_seed(0)
        model = finish(make())
        idx = tokens()
        ce = token_ce(tokens())
        return ZooModel(
            model=model,
            inputs={},
            args=(idx,),
            loss_fn=ce,
            logits_fn=lambda out: out,
            n_attention_calls=calls,
            notes=notes,
            n_classes=VOCAB,
        )

    BUILDERS[f"hand-{name}"] = build


_register("inline", InlineGPT, "attention inline in the block's forward: fused qkv Linear -> SDPA")
_register("moduledict", ModuleDictGPT, "blocks in an nn.ModuleDict")
_register("interleaved", InterleavedGPT, "flat layer list [attn, ff, attn, ff] of pre-norm residuals")
_register(
    "attention-block",
    AttentionBlockGPT,
    "block class named AttentionBlock (attention + MLP); attention via nn.MultiheadAttention, bool mask",
)
_register("token-mixer", MixerGPT, "attention module `mixer` of class TokenMixer, RMSNorm, nn.Sequential")
_register(
    "eager-interleaved-qkv",
    EagerGPT,
    "eager softmax(q @ kᵀ * scale) by hand, interleaved per-head fused qkv [q_h k_h v_h], -inf mask",
)
_register("gqa-rope", GQAGPT, "GQA (4 q / 2 kv heads), separate q/k/v Linears, RoPE before SDPA(enable_gqa)")
_register(
    "tied-logit-scale",
    TiedScaledGPT,
    "tied unembedding x @ wte.weight.T (no head Linear), logits * logit_scale (learned, 1/sqrt(d))",
)
_register(
    "child-sdpa",
    ChildSDPAGPT,
    "LLaMA-style; SDPA in a parameter-free child module returning (B, T, H, hd), reshaped and o_proj'd outside it",
)
_register(
    "nanogpt-layernorm-class",
    NanoGPTOwnLayerNorm,
    "nanoGPT as written: its own LayerNorm class (weight, bias; F.layer_norm eps 1e-5), tied lm_head",
)
_register(
    "hybrid-conv",
    HybridConvGPT,
    "hybrid [conv, attn, conv, attn]: pre-norm blocks whose mixer is a causal depthwise conv1d + Linear",
)
