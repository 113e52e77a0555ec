"""Mixed precision (fp16 + GradScaler, bf16 autocast) and torch.compile give the statistics eager fp32 gives."""

from __future__ import annotations

import pytest
import torch
from zoo import batch, lm_loss, reference_gpt

import stabkit


def test_gradscaler_overflow_is_amp_not_a_model_nan_and_norms_are_unscaled() -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(every=1, console=False), scaler=scaler)
    true_norms = {}
    for step in range(4):
        x, y = batch(step)
        loss = lm_loss(model(x), y)
        scaler.scale(loss).backward()
        if step == 2:
            model.head.weight.grad[0, 0] = float("inf")  # the fp16 overflow GradScaler exists for
        scale = scaler.get_scale()
        true_norms[step] = torch.cat([p.grad.flatten() / scale for p in model.parameters()]).norm().item()
        scaler.step(opt)
        scaler.update()
        mon.step(loss)
        opt.zero_grad()
    mon.flush()
    rows = dict(mon.history)
    assert [rows[s]["amp/overflow"] for s in range(4)] == [0.0, 0.0, 1.0, 0.0]
    assert [rows[s]["amp/scale"] for s in range(4)] == [
        1024.0,
        1024.0,
        512.0,
        512.0,
    ]  # backed off at the overflow
    for s in (0, 1, 3):
        assert rows[s]["grad/global_norm"] == pytest.approx(true_norms[s], rel=1e-5)
    assert "grad/global_norm" not in rows[2]
    kinds = [(e.kind, e.step) for e in mon.events]
    assert kinds == [("amp", 2)], kinds
    mon.detach()


def test_bf16_autocast_statistics_match_float32_to_bf16_tolerance() -> None:
    def stats(bf16: bool) -> dict[str, float]:
        torch.manual_seed(0)
        model = reference_gpt()
        mon = stabkit.attach(model, config=stabkit.MonitorConfig(every=1, console=False))
        x, y = batch(0)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
        lm_loss(logits, y).backward()
        mon.step()
        mon.flush()
        out = dict(mon.metrics)
        mon.detach()
        return out

    f32, b16 = stats(False), stats(True)
    checked = [k for k in f32 if k.split("/")[-1] in ("rms", "absmax", "logz_mean", "global_norm")]
    assert len(checked) > 10
    for k in checked:
        assert b16[k] == pytest.approx(f32[k], rel=0.05), k


def small_cfg() -> stabkit.MonitorConfig:
    return stabkit.MonitorConfig(
        every=1,
        console=False,
        modules=["blocks.0"],
        families=frozenset({"act", "grad", "logits", "loss"}),
        audit=False,
    )


def run_two_steps(mode: str) -> dict[str, float]:
    torch.manual_seed(0)
    model = reference_gpt(n_layers=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if mode == "compile_then_attach":
        fwd = torch.compile(model)
        mon = stabkit.attach(fwd, opt, config=small_cfg())
    else:
        mon = stabkit.attach(model, opt, config=small_cfg())
        fwd = torch.compile(model) if mode == "attach_then_compile" else model
    for s in range(2):
        x, y = batch(s)
        loss = lm_loss(fwd(x), y)
        loss.backward()
        opt.step()
        mon.step(loss)
        opt.zero_grad()
    mon.flush()
    out = dict(mon.metrics)
    mon.detach()
    return out


@pytest.mark.parametrize("mode", ["attach_then_compile", "compile_then_attach"])
def test_torch_compile_gives_the_eager_statistics(mode: str) -> None:
    eager = run_two_steps("eager")
    compiled = run_two_steps(mode)
    assert set(compiled) == set(eager)  # same names: a compiled model is unwrapped to the original module
    for k, v in eager.items():
        assert compiled[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
