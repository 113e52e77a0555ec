"""STABKIT_DISABLE turns attach into a no-op monitor; STABKIT_LOGDIR gives a logdir to code that passes none."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from zoo import reference_gpt, train_steps

import stabkit
from stabkit.disabled import DisabledMonitor
from stabkit.sinks import LOG_NAME, read_jsonl


def _hook_count(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    count = len(opt._optimizer_step_pre_hooks) + len(opt._optimizer_step_post_hooks)
    for m in model.modules():
        count += len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        count += len(m._backward_pre_hooks)
    for p in model.parameters():
        count += len(p._post_accumulate_grad_hooks or {}) + len(p._backward_hooks or {})
    return count


def _run(monitored: bool, tmp_path: Path) -> tuple[list[float], stabkit.Monitor | None, int]:
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if not monitored:
        return train_steps(model, opt, None, 4), None, 0
    with stabkit.attach(model, opt, logdir=tmp_path, interventions=None) as mon:
        hooks = _hook_count(model, opt)
        losses = train_steps(model, opt, mon, 4)
    return losses, mon, hooks


def test_disable_gives_a_monitor_that_hooks_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bare, _, _ = _run(False, tmp_path)
    monkeypatch.setenv("STABKIT_DISABLE", "1")
    losses, mon, hooks = _run(True, tmp_path / "off")
    assert isinstance(mon, DisabledMonitor) and isinstance(mon, stabkit.Monitor)
    assert hooks == 0
    assert losses == bare  # bit for bit: training untouched
    assert mon.global_step == 4 and mon.metrics == {} and mon.events == [] and len(mon.history) == 0
    assert mon.state_dict()["step"] == 4
    assert not (tmp_path / "off").exists()  # nothing written
    mon.detach()  # twice is safe
    with pytest.raises(RuntimeError, match="after detach"):
        mon.step(1.0)


def test_monitoring_is_on_when_disable_is_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STABKIT_DISABLE", "0")
    _, mon, hooks = _run(True, tmp_path)
    assert type(mon) is stabkit.Monitor and hooks > 0


def test_disable_with_interventions_warns_that_they_stay_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STABKIT_DISABLE", "yes")
    model = reference_gpt()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.warns(UserWarning, match="not switched on"):
        mon = stabkit.attach(model, interventions=["qk_norm"])
    assert set(model.state_dict()) == set(before)  # no qk_norm gains were added
    mon.detach()


def test_a_bad_disable_value_names_the_allowed_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STABKIT_DISABLE", "maybe")
    with pytest.raises(ValueError, match=r"STABKIT_DISABLE='maybe': use 1 .* or 0"):
        stabkit.attach(reference_gpt())


def test_env_logdir_is_used_when_the_code_passes_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STABKIT_LOGDIR", str(tmp_path / "from-env"))
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = stabkit.MonitorConfig(console=False, tensorboard=False)
    with stabkit.attach(model, opt, config=cfg) as mon:
        losses = train_steps(model, opt, mon, 2)
    assert mon.logdir == tmp_path / "from-env"
    rows = [r for r in read_jsonl(tmp_path / "from-env" / LOG_NAME) if r.get("type") == "metrics"]
    assert [r["values"]["loss"] for r in rows] == pytest.approx(losses, rel=1e-6)
    with stabkit.attach(model, opt, logdir=tmp_path / "mine", config=cfg) as mon:  # the code's logdir wins
        train_steps(model, opt, mon, 1)
    assert mon.logdir == tmp_path / "mine" and (tmp_path / "mine" / LOG_NAME).exists()
