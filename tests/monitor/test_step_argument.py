"""`Monitor.step(loss)` refuses what is not a loss with an error that names its argument and what it
accepts (it used to fail deep inside with "could not convert string to float"), and takes numbers."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from zoo import batch, lm_loss, reference_gpt

import stabkit

ACCEPTS = r"Monitor\.step\(loss\): `loss` must be a scalar tensor, a real number \(int, float, NumPy scalar\) or None"


def one_step(mon: stabkit.Monitor, model: torch.nn.Module, opt: torch.optim.Optimizer, loss: object) -> None:
    x, y = batch(0)
    lm_loss(model(x), y).backward()
    opt.step()
    mon.step(loss)  # type: ignore[arg-type]
    opt.zero_grad()


@pytest.mark.parametrize(
    ("bad", "shown"),
    [
        ("2.5x", "str '2.5x'"),
        ("2.5", "str '2.5'"),
        (b"2", "bytes b'2'"),
        ([2.5, 1.0], "list [2.5, 1.0]"),
        ({}, "dict {}"),
    ],
)
def test_what_is_not_a_loss_raises_a_type_error_naming_the_argument(bad: object, shown: str) -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with stabkit.attach(model, opt, config=stabkit.MonitorConfig(console=False, log_every=1)) as mon:
        with pytest.raises(TypeError, match=ACCEPTS + ", got " + re.escape(shown)):
            one_step(mon, model, opt, bad)
        assert len(mon.history) == 0  # the refused call closed no step
        one_step(mon, model, opt, 2.5)  # the run goes on
        assert [row["loss"] for _, row in mon.history] == [2.5]


@pytest.mark.parametrize("good", [3, 2.5, np.float32(2.5), np.float64(2.5), np.array(2.5), torch.tensor(2.5)])
def test_numbers_and_scalar_tensors_are_losses(good: object) -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with stabkit.attach(model, opt, config=stabkit.MonitorConfig(console=False, log_every=1)) as mon:
        one_step(mon, model, opt, good)
        assert [row["loss"] for _, row in mon.history] == [float(good)]  # type: ignore[arg-type]
