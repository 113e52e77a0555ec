"""The MoE detectors on a real tiny Mixtral (top-2 of 8, its balancing loss on) trained on text with
faults injected mid-run that they must find, each at its layer and step: one expert's gate bias forced
large (a collapse), an expert's gate bias forced to −1e4 (a planted dead expert), the router's weight
grown 5 % a step (router log Z drift). The same run without a fault raises none of these kinds and no
warning at all."""

from __future__ import annotations

import warnings
from functools import cache
from typing import Any

import pytest
import torch
from torch import nn

import stabkit
from stabkit.harness.data import load_corpus

from .tiny import build

STEPS = 300
FAULT_FROM = 100
MOE_KINDS = ("expert_collapse", "dead_experts", "router_z")


def biased_router(router: nn.Module, bias: torch.Tensor, state: dict[str, int]) -> None:
    """From step FAULT_FROM, the router's logits get `bias` (E,) before its softmax and top-k: the
    fault, as a forward hook that redoes Mixtral's routing (softmax, top-k, renormalised weights)."""

    def hook(module: nn.Module, args: Any, out: Any) -> Any:
        if state["step"] < FAULT_FROM:
            return None
        logits = out[0] + bias
        top, idx = logits.float().softmax(-1).topk(module.top_k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True), idx

    router.register_forward_hook(hook)


@cache
def run(fault: str, act: str = "warn") -> tuple[tuple[Any, ...], tuple[tuple[int, dict[str, float]], ...]]:
    """(events, rows) of one 300-step run with `fault` ('none', 'collapse', 'dead', 'router_z'); `act`:
    the action on expert collapse (anything but 'warn' decides that kind every step)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(
            "mixtral",
            vocab_size=256,
            num_local_experts=8,
            output_router_logits=True,
            router_aux_loss_coef=0.05,
        )
    layers = model.model.layers  # type: ignore[union-attr]
    state = {"step": 0}
    if fault == "collapse":
        biased_router(layers[1].mlp.gate, torch.tensor([20.0] + [0.0] * 7), state)
    elif fault == "dead":
        biased_router(layers[0].mlp.gate, torch.tensor([0.0] * 3 + [-1e4] + [0.0] * 4), state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    detect = stabkit.DetectConfig(actions={"expert_collapse": act})
    cfg = stabkit.MonitorConfig(
        tensorboard=False, jsonl=False, console=False, audit=False, history=None, detect=detect
    )
    mon = stabkit.attach(model, opt, config=cfg)
    data, gen = load_corpus(), torch.Generator().manual_seed(1)
    try:
        for step in range(STEPS):
            state["step"] = step
            x, _ = data.batch("train", 8, 32, gen)
            loss = model(x, labels=x).loss  # the LM loss plus 0.05 × the model's own balancing loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step(loss)
            if fault == "router_z" and step >= FAULT_FROM:
                with torch.no_grad():
                    layers[1].mlp.gate.weight.mul_(1.05)
    except stabkit.InstabilityError:  # the 'raise' action: the run stops at its event
        pass
    finally:
        mon.detach()
    return tuple(mon.events), tuple(mon.history)


def found(fault: str, kind: str) -> list[Any]:
    return [e for e in run(fault)[0] if e.kind == kind]


def test_the_healthy_run_raises_no_moe_event_and_no_warning() -> None:
    events, rows = run("none")
    assert [e for e in events if e.kind in MOE_KINDS] == []
    assert [str(e) for e in events if e.severity != "info"] == []
    last = [r["moe/model.layers.1.mlp/max_vio"] for _, r in rows if "moe/model.layers.1.mlp/max_vio" in r]
    assert len(last) == STEPS // 10 and max(last[-10:]) < 2.25  # balanced enough: below the level (0.75 × 3)


def test_a_forced_gate_bias_is_found_as_collapse_at_its_layer_and_step() -> None:
    collapse = found("collapse", "expert_collapse")
    # by hand: every token picks expert 0 from step 100 (MaxVio 3 of 3); the span ending at step s holds
    # the 21 sampled values s-200..s and 17 of them (80 % of 21 is 16.8) are collapsed at s = 260
    assert [(e.step, e.where, e.severity) for e in collapse] == [(260, "model.layers.1.mlp", "warning")]
    assert collapse[0].details["busiest_expert"] == 0 and collapse[0].details["since"] == FAULT_FROM
    assert collapse[0].value == pytest.approx(3.0)


def test_a_planted_dead_expert_is_found_when_the_probe_counts_it_dead() -> None:
    dead = found("dead", "dead_experts")
    assert [(e.step, e.where, e.details["experts"]) for e in dead] == [(190, "model.layers.0.mlp", [3])]
    assert dead[0].details["since"] == FAULT_FROM - 10  # its last sampled step with tokens
    counted = [s for s, r in run("dead")[1] if r.get("moe/model.layers.0.mlp/dead_experts", 0) > 0]
    assert counted[0] == dead[0].step
    assert found("dead", "expert_collapse") == []


def test_a_growing_router_is_found_as_router_z_drift_at_its_layer() -> None:
    drift = found("router_z", "router_z")
    assert drift and {e.where for e in drift} == {"model.layers.1.mlp"}
    first = drift[0]
    assert FAULT_FROM < first.step < STEPS and first.details["since"] >= FAULT_FROM - 100
    assert first.details["offset"] >= 3.0 and first.details["interventions"] == [
        "router_z_loss",
        "router_fp32",
    ]
    assert any(e.severity == "warning" for e in drift)


def test_decided_every_step_the_collapse_is_found_at_the_same_step() -> None:
    """An action other than 'warn' judges the kind every step from a small host copy of the counts, not
    from the log interval's rows: the same event, and 'raise' stops the run there."""
    events, rows = run("collapse", "raise")
    collapse = [(e.step, e.where) for e in events if e.kind == "expert_collapse"]
    assert collapse == [(260, "model.layers.1.mlp")]
    assert max(step for step, _ in rows) == 260
