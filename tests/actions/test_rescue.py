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
from stabkit.detectors.nonfinite import KeptForward, rng_state
from stabkit.events import Event, InstabilityError
from stabkit.interventions import active_interventions

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
    detect = stabkit.DetectConfig(actions={"attn_entropy": "rescue"}, snapshot_every=20)
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
