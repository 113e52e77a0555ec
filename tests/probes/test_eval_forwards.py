"""Only training forwards enter the statistics: validation forwards, generate() with a KV cache and
no-grad forwards between training steps leave every logged value exactly as it is without them.

The fault: between the training steps of a run, the test runs evaluation forwards (eval + no_grad,
eval with gradients, train mode under no_grad) and, for Hugging Face models, greedy ``generate()``
with a KV cache. The expectation is independent of stabkit: the same run without those forwards.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from zoo import batch, forward_logits, hf_gpt2, hf_llama, lm_loss, reference_gpt

import stabkit

BUILDS: dict[str, Callable[[], nn.Module]] = {
    "reference": reference_gpt,
    "hf_llama-sdpa-gqa": lambda: hf_llama("sdpa", kv_heads=2),
    "hf_gpt2-eager": lambda: hf_gpt2("eager"),
}
STEPS = 3


def sharpen(model: nn.Module) -> None:
    """Larger weights (HF init is tiny): attention far from uniform, so decoding would move the entropy."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)


def evaluate(model: nn.Module, generates: bool, seen: list[int]) -> None:
    """Forwards that are not training forwards, between two training steps."""
    idx, _ = batch(seed=7, bsz=2)
    model.eval()
    with torch.no_grad():
        forward_logits(model, idx)  # validation
    forward_logits(model, idx)  # eval with gradients (e.g. a saliency map): not training either
    if generates:
        out = model.generate(  # type: ignore[operator]
            idx[:, :4], max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0
        )
        assert out.shape[1] == 10
    model.train()
    with torch.no_grad():
        forward_logits(model, idx)  # train mode under no_grad (e.g. a probe of the current loss)
    seen.append(1)


def train(name: str, interleave: bool) -> tuple[list[tuple[int, dict[str, float]]], list[float], list[int]]:
    torch.manual_seed(0)
    model = BUILDS[name]()
    sharpen(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = stabkit.MonitorConfig(
        every=1, log_every=1, console=False, audit=False, attn_sample_rows=2, attn_sample_queries=8
    )
    mon = stabkit.attach(model, opt, config=cfg)
    # attention calls the probe's handler measured (an evaluation call would be one too many)
    handled: list[int] = []
    probe = next(p for p in mon.probes if p.name == "attn")
    original = probe._measure  # type: ignore[attr-defined]

    def spy(path: str, reader: Any, func: Any, args: Any, kwargs: Any) -> None:
        handled.append(1)
        original(path, reader, func, args, kwargs)

    probe._measure = spy  # type: ignore[attr-defined]
    losses, seen = [], []
    for step in range(STEPS):
        idx, tgt = batch(seed=step)
        loss = lm_loss(forward_logits(model, idx), tgt)
        loss.backward()
        opt.step()
        mon.step(loss)
        opt.zero_grad()
        losses.append(loss.item())
        if interleave and step < STEPS - 1:  # lands between this step and the next sampled one
            evaluate(model, generates=name.startswith("hf_"), seen=seen)
    mon.detach()
    return list(mon.history), losses, [*seen, len(handled)]


def same(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


@pytest.mark.parametrize("name", list(BUILDS))
def test_eval_and_generate_forwards_leave_training_statistics_unchanged(name: str) -> None:
    plain, plain_losses, plain_seen = train(name, interleave=False)
    mixed, mixed_losses, mixed_seen = train(name, interleave=True)
    assert mixed_seen[:-1] == [1] * (STEPS - 1)  # the evaluation forwards did run
    assert mixed_losses == plain_losses  # and changed no bit of training
    assert [s for s, _ in mixed] == [s for s, _ in plain] == list(range(STEPS))
    families = {k.split("/")[0] for _, row in plain for k in row}
    assert {"act", "attn", "logits", "grad"} <= families
    for (step, want), (_, got) in zip(plain, mixed, strict=True):
        diff = {k: (want.get(k), got.get(k)) for k in want.keys() | got.keys() if want.get(k) != got.get(k)}
        assert same(want, got), f"step {step}: {diff}"
    # the probe's handler saw only the training forwards' attention calls
    assert mixed_seen[-1] == plain_seen[-1]
