"""The whole-model statistics (parameter and update norms, massive activations and kurtosis, the
optimizer-state check) run on their own cadence, `MonitorConfig.deep_every` (default 5 × `every`),
while the per-layer ones keep `every`; the values on their steps are the real ones."""

from __future__ import annotations

import pytest
import torch
from zoo import batch, lm_loss, reference_gpt

import stabkit
from stabkit.config import DEEP_FACTOR


def _run(config: stabkit.MonitorConfig, steps: int) -> tuple[dict[int, dict[str, float]], dict[int, float]]:
    """(logged rows, hand-computed total update norm ‖θ_new − θ_old‖ of every step)."""
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    params = list(model.parameters())
    moved: dict[int, float] = {}
    with stabkit.attach(model, opt, config=config) as mon:
        for step in range(steps):
            x, y = batch(step)
            loss = lm_loss(model(x), y)
            loss.backward()
            before = [p.detach().clone() for p in params]
            opt.step()
            deltas = torch.stack([(p.detach() - b).norm() for p, b in zip(params, before, strict=True)])
            moved[step] = float(deltas.norm())
            mon.step(loss)
            opt.zero_grad()
        mon.flush()
        rows = dict(mon.history)
    return rows, moved


def test_default_cadence_is_five_sampled_steps_and_every_itself_at_every_step() -> None:
    assert stabkit.MonitorConfig().deep_cadence == DEEP_FACTOR * 10 == 50
    assert stabkit.MonitorConfig(every=3).deep_cadence == 15
    assert stabkit.MonitorConfig(every=1).deep_cadence == 1
    assert stabkit.MonitorConfig.full().deep_cadence == 1
    assert stabkit.MonitorConfig(every=4, deep_every=8).deep_cadence == 8


@pytest.mark.parametrize("bad", [3, 0, -4, 2.0, True])
def test_a_cadence_that_is_not_a_multiple_of_every_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="deep_every must be None or a multiple of every"):
        stabkit.MonitorConfig(every=2, deep_every=bad)  # type: ignore[arg-type]


def test_whole_model_statistics_on_their_steps_per_layer_ones_on_every_sampled_step() -> None:
    cfg = stabkit.MonitorConfig(every=2, deep_every=4, log_every=100, console=False, audit=False)
    rows, moved = _run(cfg, 9)
    deep = [s for s in rows if "update/norm" in rows[s]]
    per_layer = [s for s in rows if "grad/blocks.0/norm" in rows[s]]
    massive = [s for s in rows if "act/blocks.0/massive_ratio" in rows[s]]
    param = [s for s in rows if "param/blocks.0/norm" in rows[s]]
    checked = [s for s in rows if "update/nonfinite" in rows[s]]
    assert per_layer == [0, 2, 4, 6, 8]
    assert deep == param == massive == [0, 4, 8]
    assert checked == [0, 4, 8]  # the parameters and optimizer state checked for NaN/Inf after the update
    for s in deep:  # the update norm rebuilt from AdamW's state is the parameters' real change
        assert rows[s]["update/norm"] == pytest.approx(moved[s], rel=2e-3)
    assert all("grad/global_norm" in row for row in rows.values())  # every step


def test_default_config_takes_them_every_fiftieth_step() -> None:
    cfg = stabkit.MonitorConfig(log_every=100, console=False, audit=False)
    rows, moved = _run(cfg, 51)
    assert [s for s in rows if "update/norm" in rows[s]] == [0, 50]
    assert [s for s in rows if "grad/blocks.0/norm" in rows[s]] == [0, 10, 20, 30, 40, 50]
    assert rows[50]["update/norm"] == pytest.approx(moved[50], rel=2e-3)
