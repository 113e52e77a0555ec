"""Fault injection: an Adam second moment made negative between steps is named in the step pre-hook,
before the update it makes NaN lands (`stabkit.nonfinite.moments`).

The expectations are independent of the check: without an action the injected entry does turn the
parameter NaN in that very update (so the event really came first), with 'skip' every parameter stays
finite, and a negative entry that this step's g² outweighs leaves the update finite (a note only).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from zoo import batch, lm_loss, reference_gpt

import stabkit

TARGET = "blocks.0.attn.q_proj.weight"


def finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def run(action: str, plant: Any, steps: int = 5, at: int = 3) -> tuple[list[stabkit.Event], dict[str, Any]]:
    """Train the tiny GPT with AdamW; `plant(opt, param)` writes into the optimizer state of TARGET
    after step `at - 1` (between steps, or after its backward: it is called after the backward).
    Returns the events and what a step pre-hook registered after stabkit's saw at step `at`."""
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    param = dict(model.named_parameters())[TARGET]
    detect = stabkit.DetectConfig(
        actions={"nonfinite": action}, sync=True, options={"nonfinite": {"optimizer_check_every": 1}}
    )
    cfg = stabkit.MonitorConfig(console=False, log_every=1, detect=detect)
    seen: dict[str, Any] = {}
    with stabkit.attach(model, opt, config=cfg) as mon:

        def after_stabkit(optimizer: Any, args: Any, kwargs: Any) -> None:  # runs after stabkit's pre-hook
            if "step" in seen and "events" not in seen:
                seen["events"] = [e for e in mon.events if e.step == at]
                seen["finite"] = finite(model)

        opt.register_step_pre_hook(after_stabkit)
        for step in range(steps):
            x, y = batch(step)
            lm_loss(model(x), y).backward()
            if step == at:
                plant(opt, param)
                seen["step"] = step
            opt.step()
            if step == at:
                seen["finite_after"] = finite(model)
            mon.step()
            opt.zero_grad()
        seen["finite_end"] = finite(model)
        return list(mon.events), seen


def negative_entry(opt: torch.optim.Optimizer, param: torch.Tensor) -> None:
    with torch.no_grad():
        opt.state[param]["exp_avg_sq"].view(-1)[5] = -1.0


def test_a_negative_second_moment_is_named_before_the_nan_update_lands() -> None:
    events, seen = run("warn", negative_entry)
    named = seen["events"]  # what had been reported when the optimizer was about to update
    assert len(named) == 1 and seen["finite"]  # reported while every parameter was still finite
    e = named[0]
    assert e.kind == "nonfinite" and e.severity == "critical" and e.where == "blocks.0.attn.q_proj"
    assert e.message.startswith(f"exp_avg_sq of {TARGET} has negative entries (1 of them, min -1)")
    assert "the next Adam update is NaN" in e.message
    assert e.details["tensor"] == f"exp_avg_sq of {TARGET}" and e.details["nan_entries"] == 1
    assert seen["finite_after"] is False  # warn only: the update it named did write NaN
    assert not [e for e in events if e.kind == "nonfinite" and e.step < 3]  # nothing before the fault


def test_with_skip_the_parameters_stay_finite() -> None:
    _, seen = run("skip", negative_entry)
    assert seen["events"] and seen["events"][0].details["tensor"] == f"exp_avg_sq of {TARGET}"
    assert seen["finite_after"] and seen["finite_end"]


def test_negative_entries_this_steps_gradient_outweighs_are_a_note_and_the_update_stays_finite() -> None:
    def small_negative(opt: torch.optim.Optimizer, param: torch.Tensor) -> None:
        assert param.grad is not None
        beta2 = opt.param_groups[0]["betas"][1]
        g = param.grad.view(-1)
        i = int(g.abs().argmax())
        with torch.no_grad():  # β2·v + (1 − β2)·g² = 0.75·(1 − β2)·g² > 0 at entry i
            opt.state[param]["exp_avg_sq"].view(-1)[i] = -0.25 * (1 - beta2) * float(g[i]) ** 2 / beta2

    _, seen = run("skip", small_negative)
    e = seen["events"][0]
    assert e.severity == "info" and e.details["nan_entries"] == 0 and "update stays finite" in e.message
    assert seen["finite_after"] and seen["finite_end"]  # not skipped, and finite: a note, not an alarm


@pytest.mark.parametrize("action", ["warn", "skip"])
def test_a_clean_run_raises_nothing(action: str) -> None:
    events, seen = run(action, lambda opt, param: None)
    assert [e for e in events if e.kind == "nonfinite"] == [] and seen["finite_end"]
