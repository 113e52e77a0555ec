"""Spike detection: the rule against hand computations, the OLMo 2 spike score against a direct
reimplementation, a ×10 loss in a real run, and silence on stable runs (synthetic 2000 steps + a
real 400-step run)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from zoo import reference_gpt

import stabkit
from stabkit.detectors import DetectConfig, DetectorContext, SpikeDetector
from stabkit.detectors.rolling import MAD_TO_SIGMA

from .helpers import realistic_rows, text_batches


def fill(det: SpikeDetector, name: str, values: list[float]) -> None:
    for i, v in enumerate(values):
        det.update(i, name, v)


def judge(name: str, history: list[float], x: float, cfg: DetectConfig | None = None) -> stabkit.Event | None:
    """The verdict on `x` of a fresh detector that has seen `history`."""
    det = SpikeDetector(DetectorContext(cfg or DetectConfig()))
    fill(det, name, history)
    return det.update(len(history), name, x)[0]


def test_sigma_rule_matches_hand_computation() -> None:
    history = [1.0, 1.2] * 64  # median 1.1, MAD 0.1
    sigma = MAD_TO_SIGMA * 0.1
    line = 1.1 + 6 * sigma  # 1.99
    # loss: 1.5 × median (1.65) < the 6σ line, so the line decides
    assert judge("loss", history, line - 0.01) is None
    hit = judge("loss", history, line + 0.01)
    assert hit is not None and hit.threshold == pytest.approx(line)
    assert hit.details["z"] == pytest.approx((line + 0.01 - 1.1) / sigma)
    # grad norms must also reach 5 × median (5.5), above the 6σ line
    assert judge("grad/global_norm", history, 5.49) is None
    hit = judge("grad/global_norm", history, 5.51)
    assert hit is not None and hit.step == 128 and hit.threshold == pytest.approx(5.5)


def test_min_history_downward_and_nonfinite_values_do_not_spike() -> None:
    det = SpikeDetector(DetectorContext(DetectConfig(options={"spike": {"min_history": 10}})))
    fill(det, "loss", [2.0] * 9)
    assert det.update(9, "loss", 100.0)[0] is None  # 9 values of history < 10
    det.update(10, "loss", 2.0)
    assert det.update(11, "loss", 0.01)[0] is None  # a drop is not an instability
    assert det.update(12, "loss", math.nan) == (None, None)
    assert det.update(13, "loss", 100.0)[0] is not None


def test_megatron_factor_fires_when_sigma_is_too_wide() -> None:
    cfg = DetectConfig(options={"spike": {"sigma": 50.0, "min_history": 4}})
    history = [1.0, 2.0, 3.0, 4.0, 5.0]  # median 3, robust σ 1.48: the 50σ line is at 77
    event = judge("loss", history, 31.0, cfg)  # ≥ 10 × 3
    assert event is not None and event.threshold == pytest.approx(30.0)
    assert judge("loss", history, 29.0, cfg) is None


def test_spike_score_matches_direct_computation() -> None:
    cfg = DetectConfig(options={"spike": {"score_window": 200, "min_history": 20}})
    rng = np.random.default_rng(0)
    xs = 2.0 + 0.1 * rng.standard_normal(800)
    xs[[300, 301, 550, 700]] += [3.0, 2.0, 5.0, 0.9]
    det = SpikeDetector(DetectorContext(cfg))
    scores = [det.update(i, "loss", float(x))[1] for i, x in enumerate(xs)]
    flagged = scored = 0
    for i, x in enumerate(xs):
        prev = xs[max(0, i - 200) : i]
        if len(prev) < 20:
            assert scores[i] is None
            continue
        scored += 1
        flagged += abs(x - prev.mean()) >= 7 * prev.std()
        assert scores[i] == pytest.approx(100 * flagged / scored)
    assert flagged >= 2  # at least the +3.0 and +5.0 (30σ, 50σ) injections


def test_loss_times_ten_is_a_spike_at_that_step() -> None:
    torch.manual_seed(0)
    model = reference_gpt(vocab_size=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(console=False, detect=None, log_every=25))
    mon.install_detectors()
    spike_at = 90
    for step, (x, y) in enumerate(text_batches(100, 4, 16, seed=1)):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))
        if step == spike_at:
            loss = loss * 10
        loss.backward()
        opt.step()
        opt.zero_grad()
        mon.step(loss)
    mon.detach()
    spikes = [e for e in mon.events if e.kind == "spike"]
    assert any(e.where == "loss" and e.step == spike_at for e in spikes), spikes
    assert all(e.step == spike_at for e in spikes), [str(e) for e in spikes]
    loss_event = next(e for e in spikes if e.where == "loss")
    assert loss_event.details["ratio"] > 5 and "rollback" in loss_event.advice
    assert mon.history[-1][1]["spike/loss/score"] == pytest.approx(100 / (100 - 8))


@pytest.mark.parametrize("seed", range(5))
def test_stable_synthetic_2000_steps_give_no_events(seed: int) -> None:
    """2000 steps of series shaped and noised like the tiny GPT's measured stable runs (see
    helpers.realistic_rows), fed through the Monitor's drain path."""
    model = reference_gpt(vocab_size=256)
    mon = stabkit.attach(model, None, config=stabkit.MonitorConfig(console=False, detect=None))
    handle = mon.install_detectors()
    rows = realistic_rows(2000, seed=seed)
    for start in range(0, 2000, 50):
        handle.on_rows(rows[start : start + 50])
    mon.detach()
    assert [str(e) for e in mon.events] == []
    assert "spike/grad/global_norm/score" in rows[-1][1]


def test_stable_real_run_gives_no_events() -> None:
    torch.manual_seed(0)
    model = reference_gpt(vocab_size=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
    mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(console=False, detect=None))
    mon.install_detectors()
    for x, y in text_batches(400, 8, 16, seed=0):
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        mon.step(loss)
    mon.detach()
    assert [str(e) for e in mon.events] == []
    assert len(mon.history) == 400 and mon.history[-1][1]["loss"] < 3.5
