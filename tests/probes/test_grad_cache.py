"""The gradient probe builds its parameter lists once (at attach) and again only when they change:
a parameter unfrozen after attach, one frozen, or a new param group. Each case must be seen at the
next step, without the probe walking the model every step (`tests/monitor/test_lean_step.py`)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from zoo import batch, lm_loss, reference_gpt

import stabkit

QUIET = {"console": False, "audit": False, "detect": None}


def _norm(params: list[nn.Parameter]) -> float:
    return math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params if p.grad is not None))


def _step(model: nn.Module, opt: torch.optim.Optimizer, mon: stabkit.Monitor, seed: int) -> float:
    """One training step; returns the true global gradient norm before the update."""
    x, y = batch(seed)
    loss = lm_loss(model(x), y)
    loss.backward()
    want = _norm([p for p in model.parameters() if p.requires_grad])
    opt.step()
    mon.step(loss)
    opt.zero_grad(set_to_none=True)
    return want


def test_a_parameter_unfrozen_after_attach_gets_its_grad_stats() -> None:
    """The optimizer held the frozen block from the start (its groups do not change): only
    ``requires_grad`` flips, and the unfrozen block's norm joins the step's statistics."""
    torch.manual_seed(0)
    model = reference_gpt()
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(every=1, log_every=1, **QUIET))
    want = _step(model, opt, mon, 0)
    assert mon.metrics["grad/global_norm"] == pytest.approx(want, rel=1e-5)
    assert "grad/blocks.0/norm" not in mon.metrics
    for p in model.blocks[0].parameters():
        p.requires_grad_(True)
    x, y = batch(1)
    loss = lm_loss(model(x), y)
    loss.backward()
    want, block0 = _norm(list(model.parameters())), _norm(list(model.blocks[0].parameters()))
    opt.step()
    mon.step(loss)
    assert block0 > 0
    assert mon.metrics["grad/global_norm"] == pytest.approx(want, rel=1e-5)
    assert mon.metrics["grad/blocks.0/norm"] == pytest.approx(block0, rel=1e-5)
    mon.detach()


def test_a_parameter_frozen_after_attach_leaves_the_norm() -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(every=1, log_every=1, **QUIET))
    _step(model, opt, mon, 0)
    for p in model.blocks[1].parameters():
        p.requires_grad_(False)
    want = _step(model, opt, mon, 1)
    assert mon.metrics["grad/global_norm"] == pytest.approx(want, rel=1e-5)
    grad = next(p for p in mon.probes if p.name == "grad")
    assert all(q is not p for p in model.blocks[1].parameters() for q in grad.params)  # type: ignore[attr-defined]
    mon.detach()


def test_a_new_param_group_is_seen() -> None:
    """The head trains from the start but joins the optimizer later, in a group of its own (no
    parameter changes ``requires_grad``): its group's norm appears at the next sampled step."""
    torch.manual_seed(0)
    model = reference_gpt()
    head = list(model.head.parameters())
    opt = torch.optim.SGD([p for p in model.parameters() if all(p is not h for h in head)], lr=0.01)
    mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(every=1, log_every=1, **QUIET))
    _step(model, opt, mon, 0)
    assert "grad/param_group.1/norm" not in mon.metrics
    opt.add_param_group({"params": head, "lr": 0.001})
    x, y = batch(1)
    loss = lm_loss(model(x), y)
    loss.backward()
    want = _norm(head)
    opt.step()
    mon.step(loss)
    assert mon.metrics["grad/param_group.1/norm"] == pytest.approx(want, rel=1e-5)
    mon.detach()
