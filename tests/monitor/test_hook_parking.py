"""Hook parking (`stabkit.hook_parking`): between sampled steps the modules whose every forward hook is
one of stabkit's sampled-only hooks have none (torch's fast path), before a sampled step they have them
back in their order; anyone else's hook keeps a module's hooks in place; nothing of training or of the
statistics changes; a torch.compile after attach stops parking, and code compiled while hooks were
off is recompiled with them."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from zoo import FAMILIES, batch, forward_logits, lm_loss, reference_gpt, train_steps

import stabkit
from stabkit import hook_parking

QUIET = {"console": False, "audit": False}


def _hooks(model: nn.Module) -> dict[str, tuple[list[Any], list[Any]]]:
    """Per module with forward hooks: (pre-hooks, hooks), each in the order torch runs them."""
    return {
        name: (list(m._forward_pre_hooks.values()), list(m._forward_hooks.values()))
        for name, m in model.named_modules()
        if m._forward_pre_hooks or m._forward_hooks
    }


def _attach(every: int = 4, **extra: Any) -> tuple[nn.Module, torch.optim.Optimizer, stabkit.Monitor]:
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = stabkit.attach(
        model, opt, config=stabkit.MonitorConfig(every=every, log_every=every, **QUIET, **extra)
    )
    return model, opt, mon


def test_between_sampled_steps_no_module_keeps_forward_hooks_and_they_come_back_in_order() -> None:
    model, opt, mon = _attach(every=4)
    at_attach = _hooks(model)
    assert {"blocks.0", "blocks.0.attn", "blocks.0.mlp", "head"} <= set(at_attach)
    train_steps(model, opt, mon, 1)  # step 0 (sampled) done: step 1 is not
    assert _hooks(model) == {}  # a warn-only run: not even the root (its output check is sampled too)
    assert mon.hooks.parking.parked == len(at_attach)
    train_steps(model, opt, mon, 3)  # steps 1..3: step 4 is sampled
    assert mon.global_step == 4
    assert _hooks(model) == at_attach  # the same hooks, in the same order
    mon.detach()
    assert _hooks(model) == {}


def test_statistics_and_losses_are_those_of_hooks_left_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    def run(park: bool) -> tuple[list[float], list[tuple[int, dict[str, float]]], int]:
        monkeypatch.setattr(hook_parking, "PARK", park)
        model, opt, mon = _attach(every=3, attn_every=2)
        losses = train_steps(model, opt, mon, 13)
        parked = mon.hooks.parking.parked  # step 13: neither cadence's
        mon.detach()
        return losses, list(mon.history), parked

    losses, rows, parked = run(True)
    kept_losses, kept_rows, none_parked = run(False)
    assert parked > 0 and none_parked == 0
    assert losses == kept_losses
    assert rows == kept_rows
    sampled = {step for step, values in rows if "act/blocks.0/rms" in values}
    attention = {step for step, values in rows if "attn/blocks.0.attn/max_logit" in values}
    assert sampled == {0, 3, 6, 9, 12} and attention == {0, 2, 4, 6, 8, 10, 12}
    torch.manual_seed(0)
    bare_model = reference_gpt()
    bare = train_steps(bare_model, torch.optim.AdamW(bare_model.parameters(), lr=1e-3), None, 13)
    assert losses == bare


@pytest.mark.parametrize(
    "family", ["nanogpt", "hf_llama", "hf_llama_checkpointed", "encoder"], ids=lambda f: f
)
def test_other_models_train_and_measure_as_with_hooks_in_place(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through models stabkit did not write: a Hugging Face Llama (also with activation
    checkpointing, whose recomputation runs forward hooks during backward), nanoGPT's fused
    attention, an encoder built on ``nn.TransformerEncoder``."""

    def run(park: bool) -> tuple[list[float], list[tuple[int, dict[str, float]]], int]:
        monkeypatch.setattr(hook_parking, "PARK", park)
        torch.manual_seed(0)
        model = FAMILIES[family.removesuffix("_checkpointed")]()
        if family.endswith("_checkpointed"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(every=3, attn_every=2, **QUIET))
        losses = train_steps(lambda x: forward_logits(model, x), opt, mon, 7)
        parked = mon.hooks.parking.parked  # step 7: neither cadence's
        mon.detach()
        return losses, list(mon.history), parked

    losses, rows, parked = run(True)
    kept_losses, kept_rows, _ = run(False)
    assert parked > 0
    assert losses == kept_losses
    assert rows == kept_rows
    assert any(k.startswith("act/") for k in dict(rows)[6])


def test_parked_steps_follow_every_cadence() -> None:
    """Attention every 2, activations every 3: a step of either has hooks, one of neither has none
    (the training-forward hooks the probes read follow the gcd, 1 here: they stay)."""
    model, opt, mon = _attach(every=3, attn_every=2)
    seen = {}
    for step in range(1, 8):
        train_steps(model, opt, mon, 1)
        assert mon.global_step == step
        seen[step] = set(_hooks(model))
    attn, mlp = "blocks.0.attn", "blocks.0.mlp"
    assert {s for s, names in seen.items() if attn in names} == {2, 3, 4, 6}  # attn: act (3) + scope (2)
    assert {s for s, names in seen.items() if mlp in names} == {3, 6}
    mon.detach()


def test_a_hook_of_someone_else_keeps_the_module_as_it_is() -> None:
    model, opt, mon = _attach(every=4)
    calls: list[int] = []
    theirs = model.blocks[0].mlp.register_forward_hook(lambda m, a, out: calls.append(mon.global_step))
    order = _hooks(model)["blocks.0.mlp"]
    train_steps(model, opt, mon, 2)
    assert _hooks(model)["blocks.0.mlp"] == order  # not parked: nothing reordered around theirs
    assert "blocks.1.mlp" not in _hooks(model)  # the other block's is
    assert calls == [0, 1]
    theirs.remove()
    mon.detach()


def test_a_hook_registered_while_parked_runs_after_ours_and_a_removed_one_stays_removed() -> None:
    model, opt, mon = _attach(every=4)
    at_attach = _hooks(model)["blocks.1"]
    train_steps(model, opt, mon, 1)  # step 1: parked
    assert "blocks.1" not in _hooks(model)
    calls: list[int] = []

    def hook(m: nn.Module, a: Any, out: Any) -> None:
        calls.append(mon.global_step)

    model.blocks[1].register_forward_hook(hook)  # the module is not all ours any more: it stays as it is
    train_steps(model, opt, mon, 3)
    assert _hooks(model)["blocks.1"] == (at_attach[0], [*at_attach[1], hook])
    assert calls == [1, 2, 3]
    mon.detach()  # removes ours, including any parked at the time: theirs is left
    assert _hooks(model) == {"blocks.1": ([], [hook])}


def test_detach_while_parked_leaves_no_hook_and_attach_again_works() -> None:
    model, opt, mon = _attach(every=4)
    train_steps(model, opt, mon, 2)
    assert mon.hooks.parking.parked > 0
    mon.detach()
    assert _hooks(model) == {}
    again = stabkit.attach(model, opt, config=stabkit.MonitorConfig(every=4, **QUIET))
    train_steps(model, opt, again, 1)
    assert again.metrics["act/blocks.0/rms"] > 0
    again.detach()


def test_load_state_dict_parks_for_the_step_it_resumes_at() -> None:
    model, _, mon = _attach(every=4)
    mon.load_state_dict({"step": 7})
    assert _hooks(model) == {}
    mon.load_state_dict({"step": 8})
    assert "blocks.0" in _hooks(model)
    mon.detach()


def test_compiled_on_a_parked_step_is_recompiled_with_the_hooks() -> None:
    """Dynamo does not see hooks come back: a model first compiled while hooks were off would never
    take per-layer statistics. Parking stops, compiled code is reset (said once), the next sampled
    step measures."""
    model, opt, mon = _attach(every=4, detect=None)
    train_steps(model, opt, mon, 1)  # step 1 is parked
    forward = torch.compile(model, backend="eager")
    x, y = batch(1)
    loss = lm_loss(forward(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    with pytest.warns(RuntimeWarning, match="recompiles once"):
        mon.step(loss)
    assert mon.hooks.parking.stopped and mon.hooks.parking.parked == 0
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        train_steps(forward, opt, mon, 2)  # steps 2, 3: no second warning, hooks stay
        assert "blocks.0" in _hooks(model)
        train_steps(forward, opt, mon, 1)  # step 4: sampled, compiled
    assert [w for w in said if "stabkit" in str(w.message)] == []
    mon.flush()
    rows = dict(mon.history)
    assert rows[4]["act/blocks.0/rms"] > 0
    mon.detach()


def test_compiled_on_a_sampled_step_stops_parking_without_a_reset(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, mon = _attach(every=4, detect=None)
    resets: list[bool] = []
    monkeypatch.setattr("stabkit.hook_parking.forget_compiled_code", lambda warn=True: resets.append(warn))
    forward = torch.compile(model, backend="eager")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        train_steps(forward, opt, mon, 2)
    assert [w for w in said if "stabkit" in str(w.message)] == []
    assert mon.hooks.parking.stopped and resets == []
    assert "blocks.0" in _hooks(model)  # hooks stay on from the first compile on
    mon.detach()


def test_a_parking_failure_warns_once_and_monitoring_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose hook dicts parking cannot handle (injected: the park raises) gets one warning;
    training and the statistics go on, with every hook in place."""
    model, opt, mon = _attach(every=4)
    at_attach = _hooks(model)

    def broken(self: Any) -> None:
        raise RuntimeError("hook dict of an unknown kind")

    monkeypatch.setattr(hook_parking._Module, "park", broken)
    with pytest.warns(RuntimeWarning, match="hook dict of an unknown kind"):
        train_steps(model, opt, mon, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train_steps(model, opt, mon, 4)  # said once; steps 1..4
    assert mon.hooks.parking.stopped and _hooks(model) == at_attach
    mon.flush()
    assert dict(mon.history)[4]["act/blocks.0/rms"] > 0
    mon.detach()
