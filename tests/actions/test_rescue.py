"""The 'rescue' action: how close each fix is to the identity at the switch, the rescue limit, a
rescue that fails, and a rescue on a real training loop with an injected fault."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from zoo import reference_gpt

import stabkit
from stabkit.actions import ActionContext
from stabkit.actions.rescue import Rescue
from stabkit.events import Event, InstabilityError
from stabkit.interventions import active_interventions
from stabkit.nonfinite.guard import KeptForward, rng_state

from ..detectors.helpers import text_batches, train_with_logit_fault


def trained(steps: int = 50) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """A tiny GPT after a few high-LR steps (logits well away from init), and a held batch."""
    torch.manual_seed(0)
    model = reference_gpt(vocab_size=256, context=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batches = list(text_batches(steps + 1, 8, 32, seed=0))
    for x, y in batches[:steps]:
        torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt, batches[steps][0]


def logged_metrics(model: torch.nn.Module, x: torch.Tensor) -> dict[str, float]:
    mon = stabkit.attach(model, config=stabkit.MonitorConfig(console=False, every=1, detect=None))
    model(x)
    mon.step()
    mon.flush()
    mon.detach()
    return dict(mon.metrics)


def rescue_with(
    fix: str, model: torch.nn.Module, opt: Any, x: torch.Tensor, **options: Any
) -> tuple[Rescue, list]:
    kept = [KeptForward((x,), {}, *rng_state(), [])]
    metrics = logged_metrics(model, x)
    reported: list[Event] = []
    cfg = stabkit.DetectConfig(options={"rescue": {"fixes": [fix], **options}})
    ctx = ActionContext(
        model,
        opt,
        cfg,
        forwards=lambda: kept,
        logdir=lambda: None,
        metrics=lambda: metrics,
        report=reported.append,
    )
    return Rescue(ctx), reported


def event(step: int, fix: str) -> Event:
    return Event(
        step, "drift", "attn/x/max_logit", 1.0, 0.0, "m", details={"advice": "sig", "interventions": [fix]}
    )


@pytest.mark.parametrize(
    ("fix", "bound"), [("z_loss", 0.0), ("logit_softcap", 0.02), ("attn_softcap", 0.02), ("qk_norm", 0.1)]
)
def test_each_fix_is_close_to_the_identity_at_the_switch(fix: str, bound: float) -> None:
    model, opt, x = trained()
    with torch.no_grad():
        before = model(x).clone()
    action, reported = rescue_with(fix, model, opt, x)
    e = event(50, fix)
    assert action.run(e, before_update=True) is True  # the step's update is skipped (rolled back)
    record = e.details["rescue"]
    with torch.no_grad():  # the measurement against an independent forward after the switch
        after = model(x)
    change = float((after - before).norm() / before.norm())
    assert record["output_change"] == pytest.approx(change, rel=1e-4, abs=1e-7)
    assert change <= bound
    assert fix in active_interventions(model)
    assert [r.kind for r in reported] == ["rescue"] and reported[0].where == fix
    if fix == "qk_norm":  # gains matched to the scale of q and k: closer than gains of one
        assert len(opt.param_groups) == 2 and opt.param_groups[1]["weight_decay"] == 0.0
        unmatched = qk_norm_change_with_unit_gains()
        assert change < unmatched, (change, unmatched)
    if fix.endswith("softcap"):  # the cap starts above the newest logged max logit
        assert record["options"]["cap"] >= 2 * 0.99 * max(
            v for k, v in logged_metrics(model, x).items() if k.endswith("max_logit") or k == "logits/max_abs"
        ) or record["options"]["cap"] in (30.0, 50.0)


def qk_norm_change_with_unit_gains() -> float:
    model, _, x = trained()
    with torch.no_grad():
        before = model(x).clone()
        stabkit.interventions.apply(model, "qk_norm")
        return float((model(x) - before).norm() / before.norm())


def test_the_limit_and_a_rescue_that_fails() -> None:
    model, opt, x = trained(20)
    action, reported = rescue_with("z_loss", model, opt, x, max_rescues=1, window=100)
    first = event(20, "z_loss")
    action.run(first, before_update=False)
    assert first.details["rescue"]["fix"] == "z_loss"
    later = event(500, "logit_softcap")  # another signature-free fix, long after: the limit holds
    later.details["advice"] = "other"
    assert action.run(later, before_update=False) is False
    assert "limit of 1 rescue" in later.details["rescue"]
    again = event(60, "z_loss")  # the same signature within the window: the rescue failed
    with pytest.raises(InstabilityError) as info:
        action.run(again, before_update=False)
    assert info.value.event is again and again.details["rescue"].startswith("failed")
    assert [r.kind for r in reported] == ["rescue", "drift", "rescue"] and reported[-1].details["failed"]


def test_more_events_of_the_rescued_step_are_not_a_failure() -> None:
    model, opt, x = trained(20)
    action, reported = rescue_with("z_loss", model, opt, x, window=100)
    first, second = event(20, "z_loss"), event(20, "z_loss")  # the same drift in two layers
    action.run(first, before_update=False)
    assert action.run(second, before_update=False) is False
    assert second.details["rescue"] == "not attempted: rescued at this step already (z_loss)"
    assert len(action.done) == 1 and [r.kind for r in reported] == ["rescue"]
    with pytest.raises(InstabilityError):  # a step later it is the same trouble again: failed
        action.run(event(21, "z_loss"), before_update=False)


def test_a_second_rescue_never_restores_a_snapshot_from_before_the_first() -> None:
    model, opt, x = trained(20)
    action, _ = rescue_with("qk_norm", model, opt, x, window=10)
    action.options = type(action.options)(window=10, fixes=("qk_norm", "attn_softcap"))
    action.before_update(0)  # snapshot 0: the model without qk_norm
    first = event(20, "qk_norm")
    first.details.update(interventions=["qk_norm", "attn_softcap"], since=0)
    action.run(first, before_update=False)
    assert first.details["rescue"]["restored_step"] == 0 and "qk_norm" in active_interventions(model)
    second = event(300, "attn_softcap")  # reaches back to step 0: only a pre-qk_norm snapshot is that old
    second.details.update(advice="other", since=0)
    action.run(second, before_update=False)  # used to fail: the snapshot lacks the qk_norm gains
    assert (
        second.details["rescue"]["restored_step"] is None
        and second.details["rescue"]["fix"] == "attn_softcap"
    )
    action.before_update(400)  # snapshots after the rescues cover the new gains
    third = event(420, "z_loss")
    third.details.update(advice="third", since=400)
    action.options = type(action.options)(window=10, max_rescues=3)
    action.run(third, before_update=False)
    assert third.details["rescue"]["restored_step"] == 400


def test_nothing_to_switch_on_is_said() -> None:
    model, opt, x = trained(5)
    action, _ = rescue_with("qk_norm", model, opt, x)
    e = event(5, "norm_placement")
    assert action.run(e, before_update=True) is False
    assert e.details["rescue"].startswith("not attempted")


def test_rescue_on_a_training_loop_rolls_back_switches_on_and_continues() -> None:
    torch.manual_seed(0)
    model = reference_gpt(vocab_size=256, context=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    detect = stabkit.DetectConfig(  # qk_norm (qk_clip, the first choice: test_rescue_qk_clip.py)
        actions={"attn_entropy": "rescue"},
        options={"rollback": {"snapshot_every": 20}, "rescue": {"fixes": ["qk_norm", "attn_softcap"]}},
    )
    mon = stabkit.attach(
        model, opt, config=stabkit.MonitorConfig(console=False, every=5, log_every=10, detect=detect)
    )
    losses = train_with_logit_fault(model, opt, mon, steps=160, fault_at=90)
    state = json.loads(json.dumps(mon.state_dict(), default=str))
    mon.detach()
    rescues = [e for e in mon.events if e.kind == "rescue"]
    assert len(rescues) == 1 and rescues[0].where == "qk_norm"
    record = rescues[0].details
    assert record["restored_step"] == 80 and 90 <= record["step"] <= 105  # back to before the fault
    assert "qk_norm" in active_interventions(model)  # stays on after detach: the weights trained with it
    assert torch.isfinite(torch.tensor(losses)).all()
    assert state["detectors"]["actions"]["rescue"]["rescues"][0]["fix"] == "qk_norm"
    fresh = reference_gpt(vocab_size=256, context=32)  # resuming without the fix: told to re-apply it
    mon2 = stabkit.attach(
        fresh,
        torch.optim.AdamW(fresh.parameters()),
        config=stabkit.MonitorConfig(console=False, detect=detect),
    )
    with pytest.warns(RuntimeWarning, match="interventions=\\[\\('qk_norm'"):
        mon2.load_state_dict(state)
    mon2.detach()


SCHEDULES: dict[str, Any] = {
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s)),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=40),
    "ExponentialLR": lambda opt: torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8),
}


def shadow_of(schedule: str) -> tuple[torch.optim.Optimizer, Any]:
    """An optimizer with the same settings over a dummy parameter, and the same schedule: the rates the
    schedule alone sets."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    return opt, SCHEDULES[schedule](opt)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_the_lr_factor_holds_under_a_torch_scheduler(schedule: str) -> None:
    """Two rescues with lr_factor 0.5: every later update steps at schedule × 0.5, then × 0.25 —
    neither undone by a scheduler that recomputes the LR (LambdaLR, OneCycleLR) nor compounded by one
    that multiplies the current LR (ExponentialLR); between steps each group holds the schedule's LR."""
    model, opt, x = trained(5)
    sched = SCHEDULES[schedule](opt)
    shadow_opt, shadow = shadow_of(schedule)
    action, reported = rescue_with("z_loss", model, opt, x, lr_factor=0.5, fixes=["z_loss", "logit_softcap"])
    used: list[float] = []  # the LR each update steps with (a pre-hook after the rescue's)
    opt.register_step_pre_hook(lambda o, args, kwargs: used.append(o.param_groups[0]["lr"]))
    scheduled: list[float] = []
    for step, (xb, yb) in enumerate(text_batches(12, 8, 32, seed=1)):
        if step in (4, 8):  # two rescues (two signatures): the factor 0.5, then 0.25
            e = event(step, "z_loss" if step == 4 else "logit_softcap")
            e.details["advice"] = f"sig{step}"
            action.run(e, before_update=False)
            factor = 0.5 if step == 4 else 0.25
            assert e.details["rescue"]["lr"] == pytest.approx([g["lr"] * factor for g in opt.param_groups])
        scheduled.append(shadow_opt.param_groups[0]["lr"])
        torch.nn.functional.cross_entropy(model(xb).reshape(-1, 256), yb.reshape(-1)).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        shadow_opt.step()
        shadow.step()
        assert opt.param_groups[0]["lr"] == shadow_opt.param_groups[0]["lr"]  # the schedule's own value
    factors = [1.0] * 4 + [0.5] * 4 + [0.25] * 4
    assert used == pytest.approx([s * f for s, f in zip(scheduled, factors, strict=True)], rel=1e-12)
    assert [r.details["lr_factor"] for r in reported] == [0.5, 0.5]
    assert action.lr is not None and action.lr.factor == 0.25


def test_the_lr_factor_resumes_from_the_state() -> None:
    model, opt, x = trained(5)
    action, _ = rescue_with("z_loss", model, opt, x, lr_factor=0.5)
    action.run(event(5, "z_loss"), before_update=False)
    state = json.loads(json.dumps(action.state_dict(), default=str))
    fresh = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    resumed, _ = rescue_with("z_loss", model, fresh, x)  # lr_factor 1 now: no hooks until the state says so
    assert resumed.lr is not None and not resumed.lr.attached
    resumed.load_state_dict(state)
    assert resumed.lr.factor == 0.5 and resumed.lr.attached
    p = fresh.param_groups[0]["params"][0]
    p.grad = torch.ones(3)
    fresh.step()
    assert torch.allclose(p, torch.full((3,), 1 - 0.05)) and fresh.param_groups[0]["lr"] == 0.1


def test_a_rescue_with_a_lambda_schedule_on_a_monitored_loop() -> None:
    """attach + LambdaLR + an injected fault: the rescue (attn_softcap: no new parameter group, which
    the scheduler would refuse) halves every later update's LR while the scheduler keeps its own."""
    torch.manual_seed(0)
    model = reference_gpt(vocab_size=256, context=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = SCHEDULES["LambdaLR"](opt)
    shadow_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    shadow = SCHEDULES["LambdaLR"](shadow_opt)
    options = {"rescue": {"lr_factor": 0.5, "fixes": ["attn_softcap"]}, "rollback": {"snapshot_every": 20}}
    detect = stabkit.DetectConfig(actions={"attn_entropy": "rescue"}, options=options)
    mon = stabkit.attach(
        model, opt, config=stabkit.MonitorConfig(console=False, every=5, log_every=10, detect=detect)
    )
    assert "rescue: optimizer step pre-hook" in mon.describe_hooks()  # the Monitor's, removed at detach
    used: list[float] = []
    opt.register_step_pre_hook(lambda o, args, kwargs: used.append(o.param_groups[0]["lr"]))
    scheduled: list[float] = []
    for step, (x, y) in enumerate(text_batches(130, 8, 32, seed=0)):
        if step == 90:  # block 1's attention logits ×100: its attention turns one-hot
            with torch.no_grad():
                model.blocks[1].attn.q_proj.weight.mul_(10)
                model.blocks[1].attn.k_proj.weight.mul_(10)
        scheduled.append(shadow_opt.param_groups[0]["lr"])
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step(loss)
        sched.step()
        shadow_opt.step()
        shadow.step()
        assert opt.param_groups[0]["lr"] == shadow_opt.param_groups[0]["lr"]
    mon.detach()
    rescues = [e for e in mon.events if e.kind == "rescue"]
    assert len(rescues) == 1 and rescues[0].where == "attn_softcap"
    at = rescues[0].step  # decided at Monitor.step, after that step's update
    assert used[: at + 1] == pytest.approx(scheduled[: at + 1], rel=1e-12)
    assert used[at + 1 :] == pytest.approx([0.5 * s for s in scheduled[at + 1 :]], rel=1e-12)


def test_a_fix_that_refuses_the_model_hands_on_to_the_next_and_training_goes_on() -> None:
    torch.manual_seed(0)
    model = reference_gpt(vocab_size=256, context=32, qk_norm=True)  # qk_clip refuses normalised q/k
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = next(iter(text_batches(1, 8, 32, seed=0)))[0]
    action, reported = rescue_with("qk_clip", model, opt, x, fixes=["qk_clip", "z_loss"])
    e = event(10, "qk_clip")
    e.details["interventions"] = ["qk_clip", "z_loss"]
    action.run(e, before_update=False)
    record = e.details["rescue"]
    assert record["fix"] == "z_loss" and list(active_interventions(model)) == ["z_loss"]
    assert len(record["refused"]) == 1 and record["refused"][0].startswith("qk_clip: ")
    assert "normalised" in record["refused"][0]
    assert [r.kind for r in reported] == ["rescue"] and reported[0].where == "z_loss"

    alone, reported = rescue_with("qk_clip", model, opt, x)  # the only fix refuses: said, nothing raised
    lone = event(20, "qk_clip")
    assert alone.run(lone, before_update=True) is False  # no snapshot, nothing rolled back: the step goes on
    assert lone.details["rescue"].startswith(
        "not attempted: every fix it names refused this model (qk_clip: "
    )
    assert reported == [] and list(active_interventions(model)) == ["z_loss"]


def test_without_rollback_the_fix_goes_on_where_the_run_is() -> None:
    model, opt, x = trained(20)
    action, _ = rescue_with("z_loss", model, opt, x, rollback=False)
    action.before_update(0)  # a snapshot the rescue could restore
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)  # the run moved on since
    now = {k: v.clone() for k, v in model.state_dict().items()}
    e = event(20, "z_loss")
    e.details.update(since=0)
    assert action.run(e, before_update=False) is False
    record = e.details["rescue"]
    assert (
        record["restored_step"] is None
        and record["steps_lost"] == 0
        and "z_loss" in active_interventions(model)
    )
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in now.items())  # nothing restored
