"""The non-finite check after an update reads only what the update-norm pass did not.

- AdamW with weight decay: the gradient probe's closed-form update norms read every parameter and
  both moments; the watch then reads none of them (only the step counts), and a NaN or ±Inf
  planted in a parameter or a moment after the update, before the checks, is still flagged
  (``update/nonfinite`` = 1 on that step, 0 on a clean one) — v = +Inf included, which leaves the
  update at 0 and shows only in √v + ε.
- Adam without weight decay: the update does not read θ; the watch reads the parameters itself and
  still finds a planted NaN there.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from zoo import batch, lm_loss, reference_gpt

import stabkit
import stabkit.nonfinite.watch as watch_module


def run_step(opt_cls: Any, plant: tuple[str, float] | None, **opt_kwargs: Any) -> tuple[float, list[Any]]:
    """One monitored step (full monitoring) after a clean one; `plant` = (what, value) written into
    the first parameter or its state right after the update. Returns (update/nonfinite of that step,
    the tensors the watch's own check read)."""
    torch.manual_seed(0)
    model = reference_gpt()
    opt = opt_cls(model.parameters(), lr=1e-3, **opt_kwargs)
    first = next(model.parameters())
    armed = [False]

    def poison(optimizer: Any, args: Any, kwargs: Any) -> None:  # registered first: runs first
        if armed[0] and plant is not None:
            what, value = plant
            target = first if what == "param" else opt.state[first][what]
            with torch.no_grad():
                target.view(-1)[3] = value

    opt.register_step_post_hook(poison)
    read: list[Any] = []
    flag_of = watch_module.nonfinite_flag

    def spy(tensors: Any, **kw: Any) -> Any:
        tensors = list(tensors)
        read.append(tensors)
        return flag_of(tensors, **kw)

    cfg = stabkit.MonitorConfig.full(console=False, log_every=1)
    with stabkit.attach(model, opt, config=cfg) as mon:
        for step in range(2):
            armed[0] = step == 1
            read.clear()
            x, y = batch(step)
            lm_loss(model(x), y).backward()
            watch_module.nonfinite_flag = spy
            try:
                opt.step()
            finally:
                watch_module.nonfinite_flag = flag_of
            mon.step()
            opt.zero_grad()
        rows = dict(mon.history)
    return rows[1]["update/nonfinite"], read[-1] if read else []


def test_adamw_the_watch_reads_no_parameter_or_moment_the_update_pass_read() -> None:
    value, read = run_step(torch.optim.AdamW, None, weight_decay=0.1)
    assert value == 0.0
    assert read and all(t.dim() == 0 for t in read)  # only the step counts are left to it


@pytest.mark.parametrize(
    "plant",
    [
        ("param", math.nan),
        ("param", math.inf),
        ("exp_avg", math.nan),
        ("exp_avg", -math.inf),
        ("exp_avg_sq", math.nan),
        ("exp_avg_sq", math.inf),  # u = m / (√v + ε) = 0 there: seen in √v + ε
    ],
)
def test_adamw_a_value_planted_after_the_update_is_flagged(plant: tuple[str, float]) -> None:
    value, _ = run_step(torch.optim.AdamW, plant, weight_decay=0.1)
    assert value == 1.0


def test_adam_without_weight_decay_the_watch_reads_the_parameters_itself() -> None:
    value, read = run_step(torch.optim.Adam, ("param", math.nan))
    assert value == 1.0
    assert any(t.dim() > 0 for t in read)  # θ is not in Adam's update without decay
