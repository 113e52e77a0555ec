"""Issue 25's detectors: update-norm spikes, outlier onsets (massive activations, sink growth,
kurtosis growth) and the depth-gradient imbalance of post-norm without warmup — on recorded series
with known answers (no model) and on a real model with an injected fault."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from zoo import reference_gpt

import stabkit
from stabkit.detectors import BlockInfo, DetectConfig, DetectorContext, Judge

from .helpers import text_batches, train_with_fault

BLOCKS = tuple(BlockInfo(f"blocks.{i}", i, "pre") for i in range(6))


def judge(warmup: int | None = None, blocks: tuple[BlockInfo, ...] = BLOCKS, **options: dict) -> Judge:
    cfg = DetectConfig(options=options)
    return Judge(DetectorContext(cfg, attention_paths=("blocks.0.attn",), blocks=blocks, warmup_steps=warmup))


def events(j: Judge, rows: list[tuple[int, dict[str, float]]], kind: str) -> list[stabkit.Event]:
    return [e for e in j.rows(rows) if e.kind == kind]


# ---------------------------------------------------------------- update_norm


def update_rows(n: int, spike_at: int | None = None, factor: float = 3.0, warmup: int = 0) -> list:
    """Sampled update norms (every 10 steps): log-noise σ 0.08 around a slow decay, a linear LR
    warmup over the first `warmup` steps, and a spike of `factor`× at value `spike_at`."""
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        step = 10 * i
        ramp = min(1.0, (step + 10) / warmup) if warmup else 1.0
        v = ramp * (1.0 + 0.5 * math.exp(-step / 500)) * math.exp(0.08 * rng.standard_normal())
        if spike_at is not None and i in (spike_at, spike_at + 1):
            v *= factor
        rows.append((step, {"update/norm": v, "update/blocks.0/norm": v / 3, "loss": 2.0}))
    return rows


def test_update_norm_spike_is_found_once_where_it_was_planted() -> None:
    found = events(judge(), update_rows(60, spike_at=40), "update_norm")
    assert [(e.step, e.where) for e in found] == [(400, "update/norm"), (400, "update/blocks.0/norm")]
    e = found[0]
    assert e.details["ratio"] == pytest.approx(3.0, rel=0.25)
    assert e.details["advice"] == "update_norm_spike" and "Marin" in e.advice


def test_update_norm_is_silent_on_noise_warmup_and_before_its_history() -> None:
    assert events(judge(), update_rows(200), "update_norm") == []
    assert events(judge(), update_rows(200, warmup=1000), "update_norm") == []  # the LR ramp
    assert events(judge(), update_rows(60, spike_at=5), "update_norm") == []  # < min_history values
    small = events(judge(), update_rows(60, spike_at=40, factor=1.6), "update_norm")
    assert small == []  # below Marin's 2×


def test_a_warmup_that_doubles_the_update_norm_is_silent_per_unit_of_lr() -> None:
    """Hugging Face GPT-2, LR 3e-3 with 100 warmup steps, raised 'update_norm' at step 52 (2.1× its
    rolling median): Adam's update is the LR times a normalised step, so the ramp doubles it. With the
    optimizer's LR beside it (``opt/lr``, as the Monitor logs it) the rule judges update/LR: flat."""
    rng = np.random.default_rng(1)
    rows = []
    for step in range(200):
        lr = 3e-3 * min(1.0, (step + 1) / 100)
        update = 40.0 * lr * math.exp(0.05 * rng.standard_normal())
        rows.append((step, {"opt/lr": lr, "update/norm": update}))
    assert events(judge(), rows, "update_norm") == []
    spiked = [(s, dict(r, **({"update/norm": 3 * r["update/norm"]} if s == 60 else {}))) for s, r in rows]
    assert [(e.step, e.where) for e in events(judge(), spiked, "update_norm")] == [(60, "update/norm")]


def test_update_norm_state_round_trips() -> None:
    rows = update_rows(60, spike_at=40)
    a = judge()
    a.rows(rows[:30])
    b = judge()
    b.load_state_dict(a.state_dict())
    assert [e.step for e in events(b, rows[30:], "update_norm")] == [400, 400]


# ---------------------------------------------------------------- outliers


def outlier_rows(n: int, onset: int | None = None) -> list:
    rng = np.random.default_rng(1)
    rows = []
    for i in range(n):
        grown = onset is not None and i >= onset
        rows.append(
            (
                10 * i,
                {
                    "act/blocks.1/massive_ratio": (400.0 if grown else 6.0)
                    * math.exp(0.05 * rng.standard_normal()),
                    "act/blocks.1/kurtosis": (300.0 if grown else 0.5) + 0.1 * rng.standard_normal(),
                    "attn/blocks.0.attn/first_key_mass": (0.9 if grown else 0.2)
                    + 0.02 * rng.standard_normal(),
                },
            )
        )
    return rows


def test_outlier_onsets_fire_after_persist_values_with_their_signatures() -> None:
    j = judge()
    found = events(j, outlier_rows(40, onset=20), "outliers")
    assert sorted((e.step, e.details["advice"]) for e in found) == [
        (220, "attention_sink_growth"),
        (220, "kurtosis_growth"),
        (220, "massive_activation_onset"),
    ]
    massive = next(e for e in found if e.where.endswith("massive_ratio"))
    assert massive.details["since"] == 200 and massive.details["start"] == pytest.approx(6.0, rel=0.1)
    assert massive.threshold == 100.0


def test_outliers_are_silent_on_steady_series_and_rearm() -> None:
    assert events(judge(), outlier_rows(100), "outliers") == []
    rows = outlier_rows(40, onset=20)
    back = [
        (400 + s, {k: (6.0 if "massive" in k else 0.5 if "kurt" in k else 0.2) for k in r})
        for s, r in rows[:5]
    ]
    again = [(450 + s, r) for s, r in rows[20:25]]
    found = events(judge(), rows + back + again, "outliers")
    assert len([e for e in found if e.where.endswith("massive_ratio")]) == 2


def test_outlier_options_change_the_levels() -> None:
    j = judge(outliers={"massive_level": 1000.0})
    found = events(j, outlier_rows(40, onset=20), "outliers")
    assert not [e for e in found if e.where.endswith("massive_ratio")]
    with pytest.raises(ValueError, match="outliers"):
        DetectConfig(options={"outliers": {"sink_level": 2.0}})


# ---------------------------------------------------------------- depth_grad


POST = tuple(BlockInfo(f"blocks.{i}", i, "post") for i in range(6))


def grad_rows(ratio: float, n: int = 8, lrs: list[float] | None = None) -> list:
    """Rows of steps 0..n-1: the first and last block's gradient norms on step 0 (last/first =
    `ratio`), the loss, and the optimizer's LR of each step when `lrs` is given."""
    rows = []
    for step in range(n):
        row: dict[str, float] = {"loss": 5.0}
        if step == 0:
            row.update({"grad/blocks.0/norm": 1.0, "grad/blocks.5/norm": ratio})
        if lrs is not None:
            row["opt/lr"] = lrs[step]
        rows.append((step, row))
    return rows


def test_depth_imbalance_fires_once_the_lr_shows_no_warmup() -> None:
    found = events(judge(blocks=POST), grad_rows(0.9, lrs=[1e-2] * 8), "depth_grad")  # 0.9·√6 = 2.2
    assert [e.step for e in found] == [5]  # step 0 measured, steps 1..5 of constant LR: no warmup
    assert found[0].value == pytest.approx(0.9 * math.sqrt(6))
    assert found[0].details["since"] == 0 and found[0].details["lr"] == pytest.approx(1e-2)
    assert found[0].details["advice"] == "post_norm_no_warmup"
    assert found[0].details["interventions"] == ["norm_placement"]
    assert found[0].severity == "warning"
    # no LR to read (no optimizer) and no warmup given: judged at once
    assert [e.step for e in events(judge(blocks=POST), grad_rows(0.9), "depth_grad")] == [0]


def test_depth_imbalance_is_silent_with_warmup_pre_norm_shallow_models_and_late() -> None:
    ramp = [1e-3 * (s + 1) for s in range(8)]  # a linear warmup, read from the optimizer
    assert events(judge(blocks=POST), grad_rows(0.9, lrs=ramp), "depth_grad") == []
    assert events(judge(warmup=100, blocks=POST), grad_rows(0.9), "depth_grad") == []
    assert events(judge(warmup=0, blocks=POST), grad_rows(0.9), "depth_grad") != []  # 0 is no warmup
    assert events(judge(blocks=POST), grad_rows(0.35), "depth_grad") == []  # 0.35·√6 = 0.86
    # pre-norm with PyTorch's / Hugging Face's init: ratio ≈ 0.9, score ≈ √L — not post-norm imbalance
    assert events(judge(), grad_rows(0.9, lrs=[1e-2] * 8), "depth_grad") == []
    two = tuple(BlockInfo(f"blocks.{i}", i, "post") for i in range(2))
    rows = [(0, {"grad/blocks.0/norm": 1.0, "grad/blocks.1/norm": 1.0})]
    assert events(judge(blocks=two), rows, "depth_grad") == []
    late = [(1 + s, r) for s, r in grad_rows(0.9)]  # after the first step: not judged
    assert events(judge(blocks=POST), late, "depth_grad") == []


# ---------------------------------------------------------------- injected faults on a real model


def run_monitored(steps: int, fault: callable, **attach: object) -> tuple[list[stabkit.Event], list[float]]:
    torch.manual_seed(0)
    model = reference_gpt(vocab_size=256, context=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = stabkit.MonitorConfig(
        every=1, console=False, audit=False, tensorboard=False, jsonl=False, log_every=10
    )
    mon = stabkit.attach(model, opt, config=cfg, **attach)
    losses = train_with_fault(model, opt, mon, steps, fault)
    mon.detach()
    return list(mon.events), losses


def test_injected_lr_jump_is_an_event_at_once_and_update_norms_are_judged_per_unit_lr() -> None:
    def lr_jump(step: int, model: object, opt: torch.optim.Optimizer) -> None:
        if step == 45:
            for g in opt.param_groups:
                g["lr"] = 3e-2

    found, _ = run_monitored(60, lr_jump)
    jumps = [e for e in found if e.kind == "update_norm" and e.where == "opt/lr"]
    assert [(e.step, e.severity) for e in jumps] == [(45, "warning")]
    assert jumps[0].details["ratio"] == pytest.approx(30.0) and jumps[0].details["advice"] == "lr_jump"
    # the update norm per unit of LR does not jump with the rate: no update-norm spike at 45 for it
    assert not [e for e in found if e.kind == "update_norm" and e.where == "update/norm" and e.step == 45]
    assert all(e.step >= 45 for e in found if e.kind in ("update_norm", "outliers", "depth_grad"))


def test_lr_jump_rule_on_warmups_and_restarts() -> None:
    linear = [(s, {"opt/lr": 1e-3 * (s + 1) / 10}) for s in range(10)]  # ×2 at its first step
    assert events(judge(), linear, "update_norm") == []
    restart = [(s, {"opt/lr": lr}) for s, lr in enumerate([1e-3, 5e-4, 1e-4, 1e-3, 8e-3])]
    found = events(judge(), restart, "update_norm")
    assert [(e.step, e.severity) for e in found] == [(3, "info"), (4, "warning")]  # back to 1e-3; new 8e-3


def test_injected_massive_activation_is_an_onset() -> None:
    state = {"on": False}

    def plant(step: int, model: torch.nn.Module, opt: object) -> None:
        if step == 0:

            def hook(m: object, a: object, out: torch.Tensor) -> torch.Tensor | None:
                if not state["on"]:
                    return None
                out = out.clone()
                out[:, 0, 3] += 500.0
                return out

            model.blocks[0].register_forward_hook(hook, prepend=True)  # before the monitor sees it
        state["on"] = step >= 20

    found, _ = run_monitored(30, plant)
    onset = [e for e in found if e.kind == "outliers" and e.where == "act/blocks.0/massive_ratio"]
    assert [e.step for e in onset] == [22]  # persist 3: steps 20, 21, 22
    assert all(e.step >= 20 for e in found if e.kind == "outliers")


def test_post_norm_without_warmup_is_flagged_at_step_zero_and_not_with_warmup() -> None:
    from stabkit.harness.models import GPT, preset_config

    def run(placement: str, warmup: int | None) -> list[stabkit.Event]:
        torch.manual_seed(0)
        model = GPT(preset_config("tiny", n_layers=6, norm_placement=placement))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        cfg = stabkit.MonitorConfig(console=False, tensorboard=False, jsonl=False, log_every=5)
        mon = stabkit.attach(model, opt, config=cfg, warmup_steps=warmup, lr=1e-2)
        for x, y in text_batches(8, 8, 64, seed=0):
            loss = torch.nn.functional.cross_entropy(
                model(x).reshape(-1, model.config.vocab_size), y.reshape(-1)
            )
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step(loss)
        mon.detach()
        audit = {f.rule for f in mon.audit_report.findings}
        assert ("post_norm_no_warmup" in audit) == (placement == "post" and not warmup)
        return [e for e in mon.events if e.kind == "depth_grad"]

    flagged = run("post", None)  # constant LR: no warmup, seen over steps 1..5
    assert [e.step for e in flagged] == [5] and flagged[0].value > 1.3 and flagged[0].details["since"] == 0
    assert run("post", 100) == []
    assert run("pre", None) == []
