"""The rescue with QK-Clip (first choice for attention-logit growth), its learning-rate re-warmup, and
the detectors forgetting the steps a rollback undid."""

from __future__ import annotations

import pytest
import torch
from zoo import reference_gpt

import stabkit
from stabkit.actions.lr_factor import LRFactor
from stabkit.actions.rescue import RescueOptions, midrun_fixes
from stabkit.detectors import DetectConfig, DetectorContext, Judge
from stabkit.interventions import active_interventions

from ..detectors.helpers import train_with_logit_fault


def test_qk_clip_is_the_first_mid_run_fix() -> None:
    assert midrun_fixes()[0] == "qk_clip"
    assert RescueOptions().fixes[0] == "qk_clip"
    with pytest.raises(ValueError, match="fix_options"):
        RescueOptions(fix_options={"rmsnorm": {}})


def test_a_qk_clip_rescue_watches_the_optimizer_and_logs_its_clips() -> None:
    torch.manual_seed(0)
    model = reference_gpt(vocab_size=256, context=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = {"rollback": {"snapshot_every": 20}, "rescue": {"fix_options": {"qk_clip": {"tau": 3.0}}}}
    detect = stabkit.DetectConfig(actions={"attn_entropy": "rescue"}, options=options)
    mon = stabkit.attach(
        model, opt, config=stabkit.MonitorConfig(console=False, every=5, log_every=10, detect=detect)
    )
    train_with_logit_fault(model, opt, mon, steps=150, fault_at=90)
    mon.detach()
    rescues = [e for e in mon.events if e.kind == "rescue"]
    assert len(rescues) == 1 and rescues[0].where == "qk_clip"
    at = rescues[0].step
    assert rescues[0].details["restored_step"] == 80 and rescues[0].details["options"] == {"tau": 3.0}
    handle = active_interventions(model)["qk_clip"]
    assert handle.clips == 150 - at - 1  # after every optimizer step since the rescue
    rows = dict(mon.history)
    assert all("qk_clip/heads_clipped" in rows[s] for s in range(at + 1, 150))  # recorded by the monitor
    assert "qk_clip/heads_clipped" not in rows[at - 1]
    assert sum(rows[s]["qk_clip/heads_clipped"] for s in range(at + 1, 150)) > 0  # tau 3 is low: it clips
    handle.remove()


def test_the_rewarm_schedule() -> None:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    lr = LRFactor(opt)
    lr.attach(stabkit.hooks.DIRECT, "test")
    used: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: used.append(o.param_groups[0]["lr"]))
    lr.rewarm(4, 0.2)
    assert lr.effective() == pytest.approx([0.2])
    for _ in range(6):
        p.grad = torch.zeros(1)
        opt.step()
        assert opt.param_groups[0]["lr"] == 1.0  # the schedule's own value between steps
    assert used == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0, 1.0])
    assert not lr.warming
    lr.factor = 0.5  # with a rescue's factor: the product
    lr.rewarm(2, 0.5)
    for _ in range(3):
        p.grad = torch.zeros(1)
        opt.step()
    assert used[-3:] == pytest.approx([0.25, 0.375, 0.5])
    lr.remove()


def test_a_rescue_rewarms_and_the_warmup_resumes_from_its_state() -> None:
    torch.manual_seed(0)
    model = reference_gpt(vocab_size=256, context=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    options = {
        "rollback": {"snapshot_every": 20},
        "rescue": {"fixes": ["attn_softcap"], "rewarm_steps": 10, "rewarm_from": 0.1},
    }
    detect = stabkit.DetectConfig(actions={"attn_entropy": "rescue"}, options=options)
    mon = stabkit.attach(
        model, opt, config=stabkit.MonitorConfig(console=False, every=5, log_every=10, detect=detect)
    )
    used: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: used.append(o.param_groups[0]["lr"]))
    train_with_logit_fault(model, opt, mon, steps=120, fault_at=90)
    rescue = next(e for e in mon.events if e.kind == "rescue")
    assert "re-warmed from 0.1× over 10 steps" in rescue.message
    at = rescue.step
    assert used[at + 1 : at + 12] == pytest.approx([1e-3 * (0.1 + 0.09 * k) for k in range(10)] + [1e-3])
    state = mon.state_dict()
    mon.detach()
    assert "rewarm" not in state["detectors"]["actions"]["rescue"]  # done by then
    action = mon.detectors.actions.get("rescue")
    action.lr.rewarm(10, 0.1)
    action.lr.before_step(opt, (), {})  # one step into a new re-warmup
    action.lr.restore()
    saved = action.state_dict()
    assert saved["rewarm"] == [10.0, 0.1, 1.0]


def judge() -> Judge:
    return Judge(DetectorContext(DetectConfig(), attention_paths=("a",), vocab_size=256))


def test_detectors_forget_what_a_rollback_undid() -> None:
    j = judge()
    grow = [
        (5 * i, {"attn/a/max_logit": 60.0 * 1.1**i, "attn/a/min_head_entropy": 2.0, "loss": 2.0})
        for i in range(30)
    ]
    events = j.rows(grow)
    assert any(e.kind == "drift" for e in events)
    drift, entropy, spike = j["drift"], j["attn_entropy"], j["spike"]
    j.rewind(50)  # restored to before step 50
    assert all(t < 50 for t, _ in drift.series["attn/a/max_logit"].window)
    assert drift.series["attn/a/max_logit"].quiet_until == 0
    assert all(t < 50 for t, _ in entropy.recent["attn/a/min_head_entropy"])
    assert len(spike.series["loss"].window) == 10 and spike.series["loss"].steps == [5 * i for i in range(10)]
    # the same growth again after the rollback is judged on its own, not on the window before it
    again = [(50 + 5 * i, {"attn/a/max_logit": 60.0}) for i in range(5)]
    assert not [e for e in j.rows(again) if e.kind == "drift"]


def test_a_rollback_tells_the_detectors() -> None:
    torch.manual_seed(0)
    model = reference_gpt(vocab_size=256, context=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    detect = stabkit.DetectConfig(
        actions={"attn_entropy": "rollback"}, options={"rollback": {"snapshot_every": 20}}
    )
    mon = stabkit.attach(
        model, opt, config=stabkit.MonitorConfig(console=False, every=5, log_every=10, detect=detect)
    )
    seen: list[int] = []
    ctx = mon.detectors.actions.ctx
    original = ctx.rewound
    ctx.rewound = lambda step: (seen.append(step), original(step))[1]
    train_with_logit_fault(model, opt, mon, steps=130, fault_at=90)
    mon.detach()
    rollbacks = [e.details["rollback"]["restored_step"] for e in mon.events if "rollback" in e.details]
    assert seen and seen == rollbacks  # each restore is told to the detectors
