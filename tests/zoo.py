"""Tiny models of every family stabkit must handle, built from code or config classes (no download).

Each builder returns (model, loss_fn) where loss_fn(model, idx, targets) -> scalar loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stabkit.harness.models import GPT, GPTConfig

VOCAB = 64
SEQ = 16
LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


# ---------------------------------------------------------------- nanoGPT-style (fused c_attn)
class NanoAttention(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.n_head = n_head
        self.n_embd = d
        self.flash = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class NanoMLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d, bias=False)
        self.c_proj = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = NanoAttention(d, n_head)
        self.ln_2 = nn.LayerNorm(d)
        self.mlp = NanoMLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(
        self, d: int = 32, n_layer: int = 2, n_head: int = 4, vocab: int = VOCAB, ctx: int = SEQ
    ) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, d),
                wpe=nn.Embedding(ctx, d),
                h=nn.ModuleList(NanoBlock(d, n_head) for _ in range(n_layer)),
                ln_f=nn.LayerNorm(d),
            )
        )
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))
        for block in t.h:
            x = block(x)
        return self.lm_head(t.ln_f(x))


# ---------------------------------------------------------------- nn.TransformerEncoder LM
class EncoderLM(nn.Module):
    def __init__(
        self, d: int = 32, n_layer: int = 2, n_head: int = 4, vocab: int = VOCAB, norm_first: bool = False
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(
            d, n_head, 2 * d, dropout=0.0, batch_first=True, norm_first=norm_first
        )
        self.encoder = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(T)
        return self.head(self.norm(self.encoder(self.embed(idx) * math.sqrt(32), mask=mask, is_causal=True)))


# ---------------------------------------------------------------- builders
def reference_gpt(**overrides: object) -> nn.Module:
    cfg = GPTConfig(vocab_size=VOCAB, context=SEQ, d_model=32, n_layers=2, n_heads=4).updated(**overrides)
    return GPT(cfg)


def hf_gpt2(attn_implementation: str = "sdpa") -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    cfg._attn_implementation = attn_implementation
    return GPT2LMHeadModel(cfg)


def hf_llama(attn_implementation: str = "sdpa", kv_heads: int = 2) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    cfg._attn_implementation = attn_implementation
    return LlamaForCausalLM(cfg)


def forward_logits(model: nn.Module, idx: torch.Tensor) -> torch.Tensor:
    out = model(idx)
    return out if isinstance(out, torch.Tensor) else out.logits


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "reference": reference_gpt,
    "nanogpt": NanoGPT,
    "hf_gpt2": hf_gpt2,
    "hf_llama": hf_llama,
    "encoder": EncoderLM,
}


def batch(seed: int = 0, bsz: int = 4, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, VOCAB, (bsz, seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def train_steps(
    forward: Callable[[torch.Tensor], torch.Tensor],
    opt: torch.optim.Optimizer,
    mon: Any,
    steps: int,
    before_step: Callable[[int], None] = lambda step: None,
    device: str = "cpu",
) -> list[float]:
    """`steps` plain training steps on `batch(step)` (moved to `device`) with monitor `mon`
    (`mon.step(loss)` after the optimizer step; None: no monitor); `before_step(step)` runs first in
    each (e.g. to switch a fault on). Returns the losses."""
    losses = []
    for step in range(steps):
        before_step(step)
        x, y = (t.to(device) for t in batch(step))
        loss = lm_loss(forward(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if mon is not None:
            mon.step(loss)
        losses.append(float(loss.detach()))
    return losses
