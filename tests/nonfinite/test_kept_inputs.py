"""The step guard keeps each forward's inputs (and RNG, autocast) only when something can read them: a
replay (non-finite steps decided every step) or an action that re-runs or saves the step (dump,
rescue). A warn-only run puts no pre-hook on the model and keeps nothing, yet still flags a
non-finite output."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from zoo import batch, lm_loss, reference_gpt

import stabkit
from stabkit.nonfinite.guard import OUTPUT_METRIC
from stabkit.nonfinite.watch import NonfiniteWatch


def _attached(detect: stabkit.DetectConfig) -> tuple[stabkit.Monitor, torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = stabkit.MonitorConfig(every=10, log_every=5, console=False, audit=False, detect=detect)
    return stabkit.attach(model, opt, config=cfg), model, opt


def _step(mon: stabkit.Monitor, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x, y = batch(mon.global_step)
    loss = lm_loss(model(x), y)
    loss.backward()
    opt.step()
    mon.step(loss)
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    ("detect", "keeps"),
    [
        (stabkit.DetectConfig(), False),  # warn-only: decided at the log interval
        (stabkit.DetectConfig(sync=True), True),  # decided every step: a hit is replayed
        (stabkit.DetectConfig(actions={"spike": "dump"}), True),  # a dump saves the step's inputs
    ],
    ids=["warn-only", "sync", "spike-dump"],
)
def test_inputs_are_kept_only_when_something_reads_them(detect: stabkit.DetectConfig, keeps: bool) -> None:
    mon, model, opt = _attached(detect)
    watch = mon.detectors.devices["nonfinite"]
    assert isinstance(watch, NonfiniteWatch)
    assert watch.guard.keep_inputs is keeps
    pre_hooks = [h for h in model._forward_pre_hooks.values() if getattr(h, "__self__", None) is watch.guard]
    assert len(pre_hooks) == int(keeps)
    seen: list[int] = []
    probe = model.register_forward_hook(lambda m, a, out: seen.append(len(watch.guard.forwards)))
    _step(mon, model, opt)
    probe.remove()
    assert seen == [int(keeps)]  # during the step: the forward kept, or nothing
    mon.detach()


def test_a_warn_only_run_still_flags_a_nonfinite_output() -> None:
    """A NaN output makes the step's loss and gradient norm NaN, which a warn-only run records every
    step: the event comes at that step, from the loss; the output itself is checked on sampled steps."""
    mon, model, opt = _attached(stabkit.DetectConfig())
    _step(mon, model, opt)
    # before the guard's own hook: the model's output itself holds a NaN at step 1
    poison = model.register_forward_hook(lambda m, a, out: out * math.nan, prepend=True)
    _step(mon, model, opt)
    poison.remove()
    assert mon.events == []  # nothing decided before the log interval
    for _ in range(3):
        _step(mon, model, opt)
    rows = dict(mon.history)
    assert rows[0][OUTPUT_METRIC] == 0.0 and OUTPUT_METRIC not in rows[1]  # step 0 sampled, 1 not
    assert math.isnan(rows[1]["loss"]) and math.isnan(rows[1]["grad/global_norm"])
    assert [(e.step, e.where) for e in mon.events if e.kind == "nonfinite"] == [(1, "loss")]
    mon.detach()


def _poison_an_unused_position(at: set[int], mon: stabkit.Monitor) -> Callable[..., Any]:
    """A forward hook putting NaN into one logit at the first position, which the loss leaves out
    (it reads positions 1 on), on the steps `at`: the loss stays finite and, through `masked_fill`
    and the slice, so do the gradients — only a check of the output itself sees it."""

    def hook(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
        if mon.global_step not in at:
            return None
        mask = torch.zeros_like(out, dtype=torch.bool)
        mask[0, 0, 0] = True
        return out.masked_fill(mask, math.nan)

    return hook


@pytest.mark.parametrize(("every", "found"), [(None, [4]), (1, [3, 4])], ids=["sampled-steps", "every-step"])
def test_the_output_check_runs_on_sampled_steps_unless_asked_for_every_step(
    every: int | None, found: list[int]
) -> None:
    """Warn-only, `output_check_every` None (with `MonitorConfig.every` = 2 here): a NaN only the
    output holds, at step 3 (unsampled) and at step 4 (sampled), is flagged at step 4; asked for
    every step, at steps 3 and 4 (one event for the run of them)."""
    options = {} if every is None else {"output_check_every": every}
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = stabkit.MonitorConfig(
        every=2,
        log_every=8,
        console=False,
        audit=False,
        detect=stabkit.DetectConfig(options={"nonfinite": options}),
    )
    mon = stabkit.attach(model, opt, config=cfg)
    model.register_forward_hook(_poison_an_unused_position({3, 4}, mon), prepend=True)
    for _ in range(8):
        x, y = batch(mon.global_step)
        loss = lm_loss(model(x)[:, 1:], y[:, 1:])  # the poisoned position is not in the loss
        loss.backward()
        opt.step()
        mon.step(loss)
        opt.zero_grad(set_to_none=True)
    rows = dict(mon.history)
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad/global_norm"]) for r in rows.values())
    flagged = [s for s, r in rows.items() if r.get(OUTPUT_METRIC, 0.0) > 0]
    assert flagged == found
    assert [(e.step, e.where) for e in mon.events if e.kind == "nonfinite"] == [(found[0], OUTPUT_METRIC)]
    checked = [s for s, r in rows.items() if OUTPUT_METRIC in r]
    assert checked == (list(range(0, 8, 2)) if every is None else list(range(8)))
    mon.detach()
