"""The output-logit probe's mean logit (`logits/mean`) equals a hand computation."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from zoo import batch, lm_loss, reference_gpt

import stabkit
from stabkit.stats import logit_stats


def test_logit_stats_mean_by_hand() -> None:
    logits = torch.tensor([[[1.0, 2.0, 3.0], [-4.0, 0.0, -8.0]]])  # (B=1, T=2, V=3)
    max_abs, logz_mean, logz_max, mean = logit_stats(logits)
    assert mean.dtype == torch.float32 and mean.dim() == 0
    assert float(mean) == pytest.approx((1 + 2 + 3 - 4 + 0 - 8) / 6)
    assert float(max_abs) == 8.0
    lse = torch.logsumexp(logits, -1)
    assert float(logz_mean) == pytest.approx(float(lse.mean()))
    assert float(logz_max) == pytest.approx(float(lse.max()))


def test_logit_stats_mean_of_bf16_and_many_rows() -> None:
    torch.manual_seed(0)
    logits = (torch.randn(3, 37, 50) * 4 - 20).bfloat16()  # more rows than the log Z chunks
    _, _, _, mean = logit_stats(logits)
    assert mean.dtype == torch.float32
    assert float(mean) == pytest.approx(float(logits.double().mean()), rel=1e-5)


def test_probe_records_mean_logit() -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    with torch.no_grad():  # shift every logit: the mean moves with it, log Z too
        model.head.weight.add_(0.05)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(every=1, log_every=1, console=False))
    seen: dict[str, torch.Tensor] = {}

    def keep(mod: nn.Module, args: Any, out: torch.Tensor) -> None:
        seen["head"] = out.detach().clone()

    handle = model.head.register_forward_hook(keep)
    x, y = batch(3)
    loss = lm_loss(model(x), y)
    loss.backward()
    opt.step()
    mon.step(loss)
    mon.flush()
    m = mon.metrics
    handle.remove()
    mon.detach()
    assert m["logits/mean"] == pytest.approx(seen["head"].double().mean().item(), rel=1e-5, abs=1e-6)
    assert m["logits/mean"] != pytest.approx(0.0, abs=1e-3)
