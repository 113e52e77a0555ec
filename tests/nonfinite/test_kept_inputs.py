"""The step guard keeps each forward's inputs (and RNG, autocast) only when something can read them: a
replay (non-finite steps decided every step) or an action that re-runs or saves the step (dump,
rescue). A warn-only run puts no pre-hook on the model and keeps nothing, yet still flags a
non-finite output."""

from __future__ import annotations

import math

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
    assert (rows[0][OUTPUT_METRIC], rows[1][OUTPUT_METRIC]) == (0.0, 1.0)  # (the NaN update spreads after)
    assert [e.step for e in mon.events if e.kind == "nonfinite"] == [1]  # one event per run of them
    mon.detach()
