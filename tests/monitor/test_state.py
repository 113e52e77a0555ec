"""Monitor.state_dict carries the step count and the detectors' state into a resumed run."""

from __future__ import annotations

import json

import torch
from zoo import batch, lm_loss, reference_gpt

import stabkit


def run(mon: stabkit.Monitor, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for s in steps:
        x, y = batch(s)
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        mon.step(loss * (10 if s == 150 else 1))  # a loss spike the detector must flag after resuming
        opt.zero_grad()


def test_resume_continues_step_count_and_detector_history() -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    cfg = stabkit.MonitorConfig(console=False, log_every=10)
    mon = stabkit.attach(model, opt, config=cfg)
    run(mon, model, opt, range(0, 100))
    state = json.loads(json.dumps(mon.state_dict()))  # JSON-safe, as a checkpoint would store it
    mon.detach()

    resumed = stabkit.attach(model, opt, config=cfg)
    resumed.load_state_dict(state)
    assert resumed.global_step == 100
    run(resumed, model, opt, range(100, 160))
    resumed.detach()
    spikes = [e for e in resumed.events if e.kind == "spike" and e.where == "loss"]
    assert [e.step for e in spikes] == [150]

    fresh = stabkit.attach(model, opt, config=cfg)  # without the saved state it counts from step 0
    run(fresh, model, opt, range(100, 160))
    fresh.detach()
    assert [e.step for e in fresh.events if e.kind == "spike" and e.where == "loss"] == [50]
