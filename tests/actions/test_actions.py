"""Actions: skip leaves parameters and optimizer state bitwise unchanged, rollback restores a snapshot
bitwise, raise carries the event, dump saves the batch; warn-only and always-on modes; clean removal."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from zoo import batch, lm_loss, reference_gpt

import stabkit
from stabkit.detectors import DetectConfig

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4),
}


def state_copy(
    model: nn.Module, opt: torch.optim.Optimizer
) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
    params = [p.detach().clone() for p in model.parameters()]
    states = [
        {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
        for p in model.parameters()
    ]
    return params, states


def assert_bitwise(model: nn.Module, opt: torch.optim.Optimizer, saved: tuple[list, list]) -> None:
    params, states = saved
    for p, q in zip(model.parameters(), params, strict=True):
        assert torch.equal(p, q)
    for p, st in zip(model.parameters(), states, strict=True):
        now = opt.state[p]
        assert set(now) == set(st)
        for k, v in st.items():
            assert torch.equal(now[k], v) if torch.is_tensor(v) else now[k] == v


class Loop:
    """Tiny GPT + optimizer + monitor + detectors; `step(poison=...)` optionally poisons the forward."""

    def __init__(
        self, opt: str = "adamw", logdir: Any = None, monitor: dict | None = None, **detect: Any
    ) -> None:
        torch.manual_seed(0)
        self.model = reference_gpt()
        self.opt = OPTIMIZERS[opt](self.model.parameters())
        self.poison_now = False  # a "model bug": blocks.0.mlp.fc outputs NaN while this is set
        self.model.blocks[0].mlp.fc.register_forward_hook(
            lambda m, a, out: out * math.nan if self.poison_now else None
        )
        cfg = stabkit.MonitorConfig(console=False, detect=DetectConfig(**detect), **(monitor or {}))
        self.mon = stabkit.attach(self.model, self.opt, logdir=logdir, config=cfg)
        self.handle = self.mon.detectors  # installed by attach from MonitorConfig.detect
        self.saved_before_update: tuple[list, list] | None = None

    def step(self, poison: bool = False, loss_scale: float = 1.0, keep: bool = False) -> int:
        s = self.mon.global_step
        self.poison_now = poison
        x, y = batch(s)
        loss = lm_loss(self.model(x), y) * loss_scale
        loss.backward()
        if keep:
            self.saved_before_update = state_copy(self.model, self.opt)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.mon.step(loss)
        self.poison_now = False
        return s


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
def test_skip_leaves_parameters_and_optimizer_state_bitwise_unchanged(opt: str) -> None:
    loop = Loop(opt, actions={"nonfinite": "skip"})
    for _ in range(3):
        loop.step()
    saved = state_copy(loop.model, loop.opt)
    s = loop.step(poison=True)
    assert_bitwise(loop.model, loop.opt, saved)
    event = next(e for e in loop.mon.events if e.step == s)
    assert event.details["skipped_update"] is True and event.details["module"] == "blocks.0.mlp.fc"
    loop.step()  # the next clean step updates again (the skip is per step)
    assert not torch.equal(next(loop.model.parameters()), saved[0][0])


def test_skip_on_a_gradient_norm_spike() -> None:
    loop = Loop(actions={"spike": "skip"}, options={"spike": {"min_history": 8}}, act_on="info")
    for _ in range(12):
        loop.step()
    saved = state_copy(loop.model, loop.opt)
    s = loop.step(loss_scale=1e4)  # the gradient norm jumps 10⁴×: decided before the update
    assert_bitwise(loop.model, loop.opt, saved)
    spikes = [e for e in loop.mon.events if e.kind == "spike" and e.step == s]
    assert any(e.where == "grad/global_norm" and e.details.get("skipped_update") for e in spikes)
    loss_spike = next(e for e in spikes if e.where == "loss")  # decided after the update: cannot skip
    assert "not possible" in loss_spike.details["skip"]


def test_skip_on_spikes_that_could_never_act_is_refused() -> None:
    """'skip' acts before the update, on gradient spikes, which are notes: with act_on='warning' and the
    default warn globs it could never act, so the config says so; naming those series makes it valid."""
    with pytest.raises(ValueError, match="act_on='info'"):
        DetectConfig(actions={"spike": "skip"})
    DetectConfig(actions={"spike": "skip"}, act_on="info")
    DetectConfig(actions={"spike": "skip"}, options={"spike": {"warn": ["loss", "grad/*"]}})


def test_rollback_restores_the_snapshot_bitwise_in_place() -> None:
    loop = Loop(
        actions={"nonfinite": "rollback"}, options={"rollback": {"snapshot_every": 4, "snapshots": 2}}
    )
    ids = [id(p) for p in loop.model.parameters()]
    for s in range(11):
        loop.step(keep=s == 8)  # snapshot 8 is the state right before update 8
    assert [snap.step for snap in loop.handle.snapshots.snapshots] == [4, 8]
    s = loop.step(poison=True)
    assert s == 11
    assert loop.saved_before_update is not None
    assert_bitwise(loop.model, loop.opt, loop.saved_before_update)
    assert [id(p) for p in loop.model.parameters()] == ids
    event = next(e for e in loop.mon.events if e.step == s)
    assert event.details["rollback"]["restored_step"] == 8
    assert event.details["rollback"]["skipped_steps"] == [8, 11]


def test_rollback_after_the_update_on_a_loss_spike() -> None:
    loop = Loop(
        actions={"spike": "rollback"},
        options={"rollback": {"snapshot_every": 5, "snapshots": 1}, "spike": {"min_history": 8}},
    )
    for s in range(12):
        loop.step(keep=s == 10)
    s = loop.step(loss_scale=10.0)
    assert loop.saved_before_update is not None
    assert_bitwise(loop.model, loop.opt, loop.saved_before_update)
    assert {e.where for e in loop.mon.events if e.step == s} >= {"loss", "grad/global_norm"}


def test_raise_carries_the_event() -> None:
    loop = Loop(actions={"nonfinite": "raise"})
    loop.step()
    with pytest.raises(stabkit.InstabilityError) as info:
        loop.step(poison=True)
    assert info.value.event.details["pass"] == "forward"
    assert info.value.event.where == "blocks.0.mlp.fc"
    assert loop.mon.events[-1] is info.value.event


def test_dump_saves_the_batch_and_a_report(tmp_path: Any) -> None:
    loop = Loop(logdir=tmp_path, actions={"nonfinite": ["dump", "skip"]})
    loop.step()
    s = loop.step(poison=True)
    event = loop.mon.events[-1]
    saved = torch.load(event.details["dump"], weights_only=False)
    assert torch.equal(saved["inputs"][0]["args"][0], batch(s)[0])
    report = json.loads((tmp_path / "stabkit-dumps" / f"step{s:08d}-nonfinite.json").read_text())
    assert report["event"]["where"] == "blocks.0.mlp.fc" and report["nonfinite_params"] == []


def test_sync_names_the_module_of_a_nan_at_once() -> None:
    loop = Loop(monitor={"log_every": 5}, sync=True)  # decided every step, though the action is warn
    loop.step()
    s = loop.step(poison=True)
    events = [e for e in loop.mon.events if e.kind == "nonfinite"]
    assert [(e.step, e.where, e.details["pass"]) for e in events] == [(s, "blocks.0.mlp.fc", "forward")]


def test_default_decides_at_the_log_interval_on_a_cpu_too() -> None:
    loop = Loop(monitor={"log_every": 5})  # DetectConfig() on a CPU: as on an accelerator
    assert loop.mon.detectors.config.sync is False
    assert "nonfinite" in loop.mon.detectors.per_row and "nonfinite" not in loop.mon.detectors.per_step
    loop.step()
    loop.step(poison=True)
    assert loop.mon.events == []  # nothing is decided before the log interval


def test_warn_only_reports_at_the_log_interval_without_localizing() -> None:
    loop = Loop(monitor={"log_every": 5})  # the default
    loop.step()
    s = loop.step(poison=True)
    assert loop.mon.events == []  # nothing is decided between log intervals
    for _ in range(3):
        loop.step()
    events = [e for e in loop.mon.events if e.kind == "nonfinite"]
    assert len(events) == 1 and events[0].step == s  # one event per run of non-finite steps
    assert events[0].where in ("loss", "grad/global_norm", "logits/nonfinite")
    assert events[0].details["advice"] == "nonfinite_unlocalized"


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_always_on_mode_names_the_module_at_the_log_interval() -> None:
    loop = Loop(monitor={"log_every": 5}, options={"nonfinite": {"per_module": True}}, sync=False)
    loop.step()
    s = loop.step(poison=True)
    for _ in range(3):
        loop.step()
    events = [e for e in loop.mon.events if e.kind == "nonfinite"]
    assert [(e.step, e.where, e.details["pass"]) for e in events] == [(s, "blocks.0.mlp.fc", "forward")]


def test_remove_takes_every_hook_away_and_is_idempotent() -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters())
    mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(console=False, detect=None))

    def counts() -> tuple[int, ...]:
        hooks = sum(
            len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
            for m in model.modules()
        )
        return (
            hooks,
            len(opt._optimizer_step_pre_hooks),
            len(opt._optimizer_step_post_hooks),
            mon.detectors is not None and not mon.detectors.removed,
        )

    before = counts()
    with mon.install_detectors(
        DetectConfig(options={"nonfinite": {"per_module": True}}, actions={"nonfinite": "skip"})
    ) as handle:
        assert counts() != before and counts()[3]
    assert counts() == before
    handle.remove()
    assert counts() == before
    mon.detach()


def test_without_an_optimizer_the_step_is_decided_at_monitor_step() -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    mon = stabkit.attach(model, None, config=stabkit.MonitorConfig(console=False, detect=None))
    mon.install_detectors(DetectConfig(actions={"nonfinite": "raise"}))
    model.blocks[1].attn.register_forward_hook(
        lambda m, a, out: out * math.nan if mon.global_step == 1 else None
    )
    for step in range(2):
        x, y = batch(step)
        loss = lm_loss(model(x), y)
        loss.backward()
        model.zero_grad()
        if step == 0:
            mon.step(loss)
    with pytest.raises(stabkit.InstabilityError) as info:
        mon.step(loss)
    assert (info.value.event.where, info.value.event.details["pass"]) == ("blocks.1.attn", "forward")


def test_fp16_gradscaler_overflow_is_not_a_nonfinite_event() -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=1e38)
    mon = stabkit.attach(
        model, opt, config=stabkit.MonitorConfig(console=False, detect=None, log_every=3), scaler=scaler
    )
    mon.install_detectors(DetectConfig(actions={"nonfinite": "skip"}))
    for step in range(3):
        x, y = batch(step)
        loss = lm_loss(model(x), y)
        scaler.scale(loss * (1e6 if step == 0 else 1.0)).backward()  # step 0: scaled gradients overflow
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        mon.step(loss)
    kinds = [e.kind for e in mon.events]
    assert "amp" in kinds and "nonfinite" not in kinds
