"""One corpus run as a new user writes it: attach with nothing but a logdir and a config, the LR
schedule moving the optimizer's own learning rate, one `mon.step` per optimizer step, planted spikes
that scale the loss (and so the gradients)."""

from __future__ import annotations

import math
from typing import Any

import pytest

import stabkit
import stabkit.monitor
from stabkit.harness.alarms.corpus import HealthyConfig
from stabkit.harness.alarms.runner import Spike, run_config

TINY = HealthyConfig(
    "tiny", "tiny_gpt", depth=2, width=32, heads=4, batch=4, seq=32, steps=30, warmup=5, lr=3e-3, accum=2
)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Records attach's keyword arguments, mon.step calls and each optimizer's LR at each mon.step."""
    seen: dict[str, Any] = {"attach": [], "steps": 0, "lrs": []}
    real_attach, real_step = stabkit.attach, stabkit.monitor.Monitor.step

    def attach(model: Any, optimizer: Any, **kwargs: Any) -> Any:
        seen["attach"].append(set(kwargs))
        seen["opt"] = optimizer
        return real_attach(model, optimizer, **kwargs)

    def step(self: Any, loss: Any = None) -> None:
        seen["steps"] += 1
        seen["lrs"].append(seen["opt"].param_groups[0]["lr"])
        real_step(self, loss)

    monkeypatch.setattr(stabkit, "attach", attach)
    monkeypatch.setattr(stabkit.monitor.Monitor, "step", step)
    return seen


def test_a_run_attaches_like_a_new_user_and_keeps_events_and_losses(spy: dict[str, Any]) -> None:
    out = run_config(TINY, spikes=[Spike(20, 10.0)])
    assert out.error == ""
    assert spy["attach"] == [{"logdir", "config"}]  # no lr, no warmup_steps
    assert spy["steps"] == TINY.steps == len(out.losses)  # once per optimizer step, not per micro-batch
    lrs = spy["lrs"]
    assert lrs[0] == pytest.approx(3e-3 / 5) and lrs[4] == pytest.approx(3e-3)  # warmup 1/5 .. 5/5
    assert lrs[-1] < lrs[10] < lrs[4]  # then the cosine decays
    # the planted spike multiplies the loss passed to mon.step: ×10 against its neighbours
    around = [out.losses[i] for i in (18, 19, 21, 22)]
    assert 6 < out.losses[20] / (sum(around) / 4) < 15
    assert all(math.isfinite(v) for v in out.losses)
    assert out.spikes == [[20, 10.0]]
    for e in out.events:
        assert {"step", "kind", "severity", "where", "message", "details"} <= set(e)


def test_hf_model_runs_with_muon_and_bf16() -> None:
    cfg = HealthyConfig(
        "llama", "hf_llama", depth=2, width=32, heads=4, kv_heads=2, optimizer="muon", bf16=True,
        batch=4, seq=32, steps=12, warmup=3, data="zipf",
    )  # fmt: skip
    out = run_config(cfg)
    assert out.error == "" and len(out.losses) == 12
    assert out.losses[-1] < out.losses[0]
    assert out.to_dict()["first_loss"] == out.losses[0]
