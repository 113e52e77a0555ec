"""The reference GPT: a decoder-only Transformer with every variant switch the recipes need.

Module names are stable (discovery and interventions rely on them):
``tok_emb``, ``pos_emb`` (learned positions only), ``blocks.{i}.norm1``, ``blocks.{i}.attn``
(``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, optional ``q_norm``/``k_norm``),
``blocks.{i}.norm2``, ``blocks.{i}.mlp`` (``fc``, optional ``gate``, ``proj``; with ``n_experts`` a
`stabkit.harness.models.moe.MoE`: ``router.gate``, ``experts.{e}``), sandwich-only
``blocks.{i}.post_norm1``/``post_norm2``, ``final_norm``, ``head``.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ...discovery.families import STABKIT_GPT
from .config import GPTConfig
from .layers import MLP, Attention, make_norm, softcap
from .moe import MoE


class Block(nn.Module):
    """One Transformer block; its wiring follows `cfg.norm_placement`."""

    stabkit_family: ClassVar[str] = STABKIT_GPT
    """Declares the family to stabkit (`stabkit.discovery.families`): discovery reads the norm
    placement from ``placement``, ``norm1``/``norm2`` and the sandwich's ``post_norm1``/``post_norm2``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.placement = cfg.norm_placement
        self.norm1 = make_norm(cfg)
        self.attn = Attention(cfg)
        self.norm2 = make_norm(cfg)
        self.mlp: nn.Module = MoE(cfg) if cfg.n_experts else MLP(cfg)
        self.post_norm1 = make_norm(cfg) if cfg.norm_placement == "sandwich" else None
        self.post_norm2 = make_norm(cfg) if cfg.norm_placement == "sandwich" else None
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, T, d)
        if self.placement == "post":
            x = self.norm1(x + self.drop(self.attn(x)))
            return self.norm2(x + self.drop(self.mlp(x)))
        a = self.attn(self.norm1(x))
        if self.post_norm1 is not None:
            a = self.post_norm1(a)
        x = x + self.drop(a)
        m = self.mlp(self.norm2(x))
        if self.post_norm2 is not None:
            m = self.post_norm2(m)
        return x + self.drop(m)


class GPT(nn.Module):
    """Decoder-only language model. ``forward(idx (B, T) int64) -> logits (B, T, vocab)``."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()
        self.config = cfg or GPTConfig()
        c = self.config
        self.tok_emb = nn.Embedding(c.vocab_size, c.d_model)
        self.pos_emb = nn.Embedding(c.context, c.d_model) if c.positions == "learned" else None
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.final_norm = make_norm(c)
        self.head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.reset_parameters()
        if c.tie_embeddings:
            self.head.weight = self.tok_emb.weight

    def reset_parameters(self) -> None:
        """Initialise weights: Wortsman et al. 2023 by default, or N(0, init_std)."""
        c = self.config
        for name, p in self.named_parameters():
            if p.dim() < 2:
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                continue
            if c.init_std is not None:
                std = c.init_std
            elif "emb" in name:
                std = 1.0 / math.sqrt(c.d_model)
            else:
                std = 1.0 / math.sqrt(p.shape[1])
            nn.init.trunc_normal_(p, std=std, a=-2 * std, b=2 * std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 2:
            raise ValueError(f"GPT expects token ids of shape (batch, time), got {tuple(idx.shape)}")
        seq = idx.shape[1]
        if seq > self.config.context:
            raise ValueError(f"sequence length {seq} exceeds the model's context {self.config.context}")
        x = self.tok_emb(idx)  # (B, T, d)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(seq, device=idx.device))
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.final_norm(x))  # (B, T, V)
        if self.config.logit_softcap is not None:
            logits = softcap(logits, self.config.logit_softcap)
        return logits

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of `idx` against `targets` (both (B, T))."""
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    def num_parameters(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without embeddings and output head (Wortsman's convention)."""
        skip = {id(self.tok_emb.weight), id(self.head.weight)}
        if self.pos_emb is not None:
            skip.add(id(self.pos_emb.weight))
        return sum(p.numel() for p in self.parameters() if not non_embedding or id(p) not in skip)
