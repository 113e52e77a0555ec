"""Update norms rebuilt from optimizer state equal the real parameter change, for every setting."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from zoo import batch, lm_loss, reference_gpt

import stabkit
from stabkit.probes.updates import closed_form_supported, update_norms

OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw_amsgrad_max": lambda ps: torch.optim.AdamW(
        ps, lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True
    ),
    # decay so small that the one-pass rebuild would overflow: the two-pass path (`FUSED_DECAY_LIMIT`)
    "adamw_tiny_decay": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=1e-35),
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.05, betas=(0.8, 0.9)),
    "adam_foreach_off": lambda ps: torch.optim.Adam(ps, lr=3e-3, foreach=False),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_wd": lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.01),
    "sgd_momentum_wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, dampening=0.1),
    "sgd_nesterov_wd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd_maximize": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, maximize=True, weight_decay=0.01),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_closed_form_update_norms_match_real_deltas(name: str) -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    params = list(model.parameters())
    opt = OPTIMIZERS[name](params)
    assert closed_form_supported(opt)
    for step in range(3):  # several steps so momentum/moments and bias corrections are non-trivial
        x, y = batch(step)
        lm_loss(model(x), y).backward()
        before = [p.detach().clone() for p in params]
        opt.step()
        got = torch.stack(update_norms(opt, params))
        want = torch.stack([(p.detach() - b).norm() for p, b in zip(params, before)])
        torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-7)
        opt.zero_grad()


def test_unsupported_optimizer_falls_back_to_a_snapshot() -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-2)
    assert not closed_form_supported(opt)
    with stabkit.attach(model, opt, config=stabkit.MonitorConfig(every=1, console=False)) as mon:
        x, y = batch(0)
        lm_loss(model(x), y).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        mon.step()
        mon.flush()
        names = [n for n in before if n.startswith("blocks.1.")]
        now = dict(model.named_parameters())
        delta = torch.cat([(now[n].detach() - before[n]).flatten() for n in names]).norm()
        old = torch.cat([before[n].flatten() for n in names]).norm()
        assert mon.metrics["update/blocks.1/ratio"] == pytest.approx((delta / old).item(), rel=1e-4)
