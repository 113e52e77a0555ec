"""Every statistic the monitor logs equals an independent computation made by the test itself."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from zoo import batch, lm_loss, reference_gpt

import stabkit


def capture(model: nn.Module, paths: list[str]) -> tuple[dict[str, torch.Tensor], list[Any]]:
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for p in paths:

        def hook(mod: nn.Module, args: Any, out: torch.Tensor, p: str = p) -> None:
            seen[p] = out.detach().clone()

        handles.append(model.get_submodule(p).register_forward_hook(hook))
    return seen, handles


def cat_norm(tensors: list[torch.Tensor]) -> float:
    return torch.cat([t.flatten() for t in tensors]).norm().item()


@pytest.fixture
def setup() -> tuple[nn.Module, torch.optim.Optimizer, stabkit.Monitor]:
    torch.manual_seed(0)
    model = reference_gpt()
    emb = [model.tok_emb.weight, model.pos_emb.weight]
    rest = [p for p in model.parameters() if all(p is not e for e in emb)]
    opt = torch.optim.SGD([{"params": rest}, {"params": emb, "lr": 0.5}], lr=0.1, momentum=0.9)
    mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(every=1, console=False))
    return model, opt, mon


def test_activation_logit_grad_param_update_and_loss(setup: tuple[nn.Module, Any, stabkit.Monitor]) -> None:
    model, opt, mon = setup
    seen, handles = capture(model, ["blocks.0", "blocks.1.attn", "blocks.1.mlp", "head"])
    x, y = batch(3)
    loss = lm_loss(model(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)  # the monitor reports the norm before clipping
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    mon.step(loss)
    mon.flush()
    m = mon.metrics
    for h in handles:
        h.remove()

    for path in ("blocks.0", "blocks.1.attn", "blocks.1.mlp"):
        out = seen[path]
        assert m[f"act/{path}/rms"] == pytest.approx(out.pow(2).mean().sqrt().item(), rel=1e-5)
        assert m[f"act/{path}/absmax"] == pytest.approx(out.abs().max().item(), rel=1e-6)
        assert m[f"act/{path}/nonfinite"] == 0
    logits = seen["head"]
    logz = torch.logsumexp(logits, dim=-1)
    assert m["logits/max_abs"] == pytest.approx(logits.abs().max().item(), rel=1e-6)
    assert m["logits/logz_mean"] == pytest.approx(logz.mean().item(), rel=1e-5)
    assert m["logits/logz_max"] == pytest.approx(logz.max().item(), rel=1e-5)
    assert m["logits/mean"] == pytest.approx(logits.mean().item(), rel=1e-5, abs=1e-6)
    assert m["loss"] == pytest.approx(loss.item(), rel=1e-6)

    assert m["grad/global_norm"] == pytest.approx(cat_norm(list(grads.values())), rel=1e-5)
    for unit in ("blocks.0", "blocks.1"):
        names = [n for n in grads if n.startswith(unit + ".")]
        assert m[f"grad/{unit}/norm"] == pytest.approx(cat_norm([grads[n] for n in names]), rel=1e-5)
        assert m[f"param/{unit}/norm"] == pytest.approx(cat_norm([before[n] for n in names]), rel=1e-5)
        delta = [dict(model.named_parameters())[n].detach() - before[n] for n in names]
        ratio = cat_norm(delta) / cat_norm([before[n] for n in names])
        assert m[f"update/{unit}/ratio"] == pytest.approx(ratio, rel=1e-4)
    for unit in ("tok_emb", "head", "final_norm"):
        assert m[f"grad/{unit}/norm"] == pytest.approx(grads[f"{unit}.weight"].norm().item(), rel=1e-5)
    emb = ["tok_emb.weight", "pos_emb.weight"]
    assert m["grad/param_group.1/norm"] == pytest.approx(cat_norm([grads[n] for n in emb]), rel=1e-5)
    rest = [g for n, g in grads.items() if n not in emb]
    assert m["grad/param_group.0/norm"] == pytest.approx(cat_norm(rest), rel=1e-5)
    all_delta = [p.detach() - before[n] for n, p in model.named_parameters()]
    assert m["update/global_ratio"] == pytest.approx(
        cat_norm(all_delta) / cat_norm(list(before.values())), rel=1e-4
    )
    mon.detach()


def test_nonfinite_values_are_counted(setup: tuple[nn.Module, Any, stabkit.Monitor]) -> None:
    model, opt, mon = setup
    mon.detach()

    def poison(mod: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out.view(-1)[:3] = float("nan")
        out.view(-1)[3:5] = float("inf")
        return out

    model.blocks[0].mlp.register_forward_hook(poison)  # registered first, so stabkit sees the poisoned output
    mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(every=1, console=False))
    x, _ = batch(0)
    model(x)
    mon.step()
    mon.flush()
    assert mon.metrics["act/blocks.0.mlp/nonfinite"] == 5
    assert math.isnan(mon.metrics["act/blocks.0.mlp/rms"])
    assert mon.metrics["act/blocks.0.attn/nonfinite"] == 0
    mon.detach()


def test_gradient_accumulation_reports_the_accumulated_gradient() -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = stabkit.MonitorConfig(every=1, console=False)
    seen, handles = capture(model, ["blocks.1"])
    outs = []
    with stabkit.attach(model, opt, config=cfg) as mon:
        for micro in range(2):
            x, y = batch(micro)
            (lm_loss(model(x), y) / 2).backward()
            outs.append(seen["blocks.1"])
        total = cat_norm([p.grad for p in model.parameters()])
        opt.step()
        mon.step()
        mon.flush()
        assert mon.metrics["grad/global_norm"] == pytest.approx(total, rel=1e-5)
        # activation RMS combines micro-batches as the RMS of all their values
        both = torch.cat([o.flatten() for o in outs])
        assert mon.metrics["act/blocks.1/rms"] == pytest.approx(both.pow(2).mean().sqrt().item(), rel=1e-5)
        assert mon.metrics["act/blocks.1/absmax"] == pytest.approx(both.abs().max().item(), rel=1e-6)
    for h in handles:
        h.remove()


def test_sampling_cadence_and_single_host_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    model = reference_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    copies = []

    from stabkit.stats import recorder as rec_mod

    real = rec_mod.to_host

    def counting(values: torch.Tensor) -> list[float]:
        copies.append(values.numel())
        return real(values)

    monkeypatch.setattr(rec_mod, "to_host", counting)
    cfg = stabkit.MonitorConfig(every=3, log_every=6, console=False, detect=None)
    mon = stabkit.attach(model, opt, config=cfg)
    for s in range(12):
        x, y = batch(s)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        mon.step(loss)
        opt.zero_grad()
    assert len(copies) == 2, "one host copy per log interval"
    steps = [s for s, row in mon.history if "act/blocks.0/rms" in row]
    assert steps == [0, 3, 6, 9]
    assert [s for s, row in mon.history if "loss" in row] == list(range(12))
    mon.detach()
