"""Eager FlexAttention with a block mask made in each attention module's forward: the max logit is exact
at every step and every layer (a report of layer 0's value repeating from the step
before). Partial diagonal blocks (block size 8, 16 tokens), so ``mask_mod`` decides inside them; the
attention is frozen because FlexAttention's backward does not run on a CPU."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import stabkit

torch.set_num_threads(1)
D, H, T, V = 32, 4, 16, 50


def causal(b: object, h: object, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return q >= k


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.seen: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, H, -1).permute(2, 0, 3, 1, 4)
        mask = create_block_mask(causal, None, None, t, t, device="cpu", BLOCK_SIZE=8)
        self.seen = (q.detach().double(), k.detach().double())
        return self.o(flex_attention(q, k, v, block_mask=mask).transpose(1, 2).reshape(b, t, D))


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(nn.ModuleDict({"ln": nn.LayerNorm(D), "attn": Attn()}) for _ in range(2))
        self.head = nn.Linear(D, V)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block["attn"](block["ln"](x))
        return self.head(x)


def test_eager_flex_block_mask_max_logit_is_exact_across_steps_and_layers() -> None:
    torch.manual_seed(0)
    model = LM()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("head"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cfg = stabkit.MonitorConfig.full(
        attn_sample_rows=None, attn_sample_queries=None, log_every=1, console=False
    )
    gen = torch.Generator().manual_seed(1)
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # flex_attention without torch.compile
        mon = stabkit.attach(model, opt, config=cfg)
        for step in range(3):
            idx = torch.randint(0, V, (2, T + 1), generator=gen)
            loss = F.cross_entropy(model(idx[:, :-1]).reshape(-1, V), idx[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step(loss)
            for i, block in enumerate(model.blocks):
                q, k = block["attn"].seen
                logits = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
                want = float(logits.masked_fill(~allowed, 0).abs().amax())
                got = mon.metrics[f"attn/blocks.{i}.attn/max_logit"]
                assert got == pytest.approx(want, rel=1e-5), (step, i)
        mon.detach()
    torch._dynamo.reset()  # eager FlexAttention compiled its mask: leave no compiled code behind
