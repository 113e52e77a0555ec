"""The attention probe on the reference GPT's eager path under fp16 autocast: it reads the logits the
model materialised (in fp16), an overflow included, and leaves training bit for bit as it was."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import stabkit
from stabkit import MonitorConfig
from stabkit.harness.models import GPT, GPTConfig

CONFIG = MonitorConfig(
    every=1,
    attn_sample_rows=None,
    attn_sample_queries=None,
    console=False,
    strict=True,
    history=None,
    families=frozenset({"attn"}),
)


def tiny(**switches: object) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(d_model=32, n_heads=4, context=16, **switches))  # type: ignore[arg-type]


def fp16_logits(model: GPT, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each attention module's logits as the eager path makes them under fp16 autocast:
    (q16 @ k16ᵀ) · scale in fp16, causal entries only; (B, H, T, T) float32 with masked = 0."""
    out: dict[str, torch.Tensor] = {}
    hooks = []
    for i, block in enumerate(model.blocks):

        def grab(m: torch.nn.Module, args: tuple[torch.Tensor, ...], i: int = i) -> None:
            x = args[0]
            b, t, _ = x.shape
            q = m.q_proj(x).view(b, t, 4, 8).transpose(1, 2)  # (B, H, T, hd) fp16 under autocast
            k = m.k_proj(x).view(b, t, 4, 8).transpose(1, 2)
            logits = (q @ k.transpose(-2, -1)) * (8**-0.5)
            assert logits.dtype == torch.float16
            causal = torch.ones(t, t, dtype=torch.bool).tril()
            out[f"blocks.{i}.attn"] = logits.float().masked_fill(~causal, 0.0)

        hooks.append(block.attn.register_forward_pre_hook(grab))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        model(idx)
    for h in hooks:
        h.remove()
    return out


def monitored_forward(model: GPT, idx: torch.Tensor) -> dict[str, float]:
    model.train()
    mon = stabkit.attach(model, None, config=CONFIG, logdir=None)
    with torch.autocast("cpu", dtype=torch.float16):
        model(idx)
    mon.step()
    mon.flush()
    mon.detach()
    return dict(mon.metrics)


def test_probe_reads_the_fp16_logits_of_the_eager_path() -> None:
    model = tiny(attention="eager")
    with torch.no_grad():
        for block in model.blocks:
            block.attn.q_proj.weight.mul_(4.0)
    idx = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    want = fp16_logits(model, idx)
    got = monitored_forward(model, idx)
    for path, logits in want.items():
        top = logits.abs().amax().item()
        assert top > 1.0
        assert got[f"attn/{path}/max_logit"] == top  # the very fp16 values the softmax saw


def test_probe_reports_an_overflowed_logit_as_inf() -> None:
    model = tiny(attention="eager")
    with torch.no_grad():
        for block in model.blocks:  # |q·k| far beyond 65504
            block.attn.q_proj.weight.mul_(300.0)
            block.attn.k_proj.weight.mul_(300.0)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.isinf(fp16_logits(model, idx)["blocks.0.attn"]).any()
    got = monitored_forward(model, idx)
    assert got["attn/blocks.0.attn/max_logit"] == math.inf


def train(model: GPT, monitor: bool, steps: int = 4) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    config = MonitorConfig(every=1, attn_every=1, console=False)
    mon = stabkit.attach(model, opt, config=config, logdir=None) if monitor else None
    losses = []
    for _ in range(steps):
        x, y = torch.randint(0, 256, (2, 2, 16), generator=gen)
        with torch.autocast("cpu", dtype=torch.float16):
            logits = model(x)
        loss = F.cross_entropy(logits.float().reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        if mon is not None:
            mon.step(loss)
        opt.zero_grad()
        losses.append(loss.item())
    if mon is not None:
        mon.flush()
        assert all(f"attn/blocks.{i}.attn/max_logit" in mon.metrics for i in (0, 1))
        mon.detach()
    return losses


def test_monitoring_the_eager_path_leaves_training_bit_for_bit() -> None:
    for switches in ({"attention": "eager"}, {"softmax_fp32": True}):
        assert train(tiny(**switches), monitor=False) == train(tiny(**switches), monitor=True)
