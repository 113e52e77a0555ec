"""Drift (early warning): growth of attention logits, log Z and residual RMS is reported before the
run diverges, with the right advice; saturating growth and stable training stay quiet."""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch
from zoo import reference_gpt

import stabkit
from stabkit.detectors import DetectConfig, DetectorContext, DriftDetector, DriftOptions

from .helpers import text_batches


def detector(**options: object) -> DriftDetector:
    model_map = stabkit.inspect_model(reference_gpt(vocab_size=256))
    cfg = DetectConfig(options={"drift": options})
    return DriftDetector(DetectorContext.from_model_map(model_map, cfg))


def test_attention_logit_growth_warns_before_divergence() -> None:
    """Max logit grows 1.5× per 100 steps from 5; by Wortsman et al. the run diverges past 1e4."""
    det = detector()
    name = "attn/blocks.0.attn/max_logit"
    first_event, diverged = None, None
    for step in range(0, 3000, 10):
        value = 5.0 * 1.5 ** (step / 100) * (1 + 0.05 * math.sin(step))
        if value > 1e4 and diverged is None:
            diverged = step
        event = det.update(step, name, value)
        if event is not None and first_event is None:
            first_event = event
    assert first_event is not None and diverged is not None
    assert first_event.step < diverged - 500  # hundreds of steps of warning
    assert first_event.kind == "drift" and first_event.value >= 50
    expected_growth = 1.5 ** ((DriftOptions().window - 1) * 10 / 100)
    assert abs(first_event.details["growth"] - expected_growth) < 0.05 * expected_growth
    eta = first_event.details["steps_to_1e4"]
    assert abs(first_event.step + eta - diverged) < 60  # the projection lands where the logit crosses 1e4


def test_saturating_growth_and_noise_stay_quiet() -> None:
    det = detector()
    for step in range(0, 5000, 10):
        det_value = 3 + 40 * (1 - math.exp(-step / 300)) * (1 + 0.05 * math.sin(7 * step))
        assert det.update(step, "attn/blocks.1.attn/max_logit", det_value) is None
        assert det.update(step, "logits/logz_mean", 5.5 + 3 * math.sin(step / 50)) is None


def test_logz_drift_away_from_log_vocab() -> None:
    det = detector()
    events = [
        det.update(step, "logits/logz_mean", math.log(256) - 0.01 * step) for step in range(0, 3000, 10)
    ]
    hits = [e for e in events if e is not None]
    assert hits and hits[0].details["family"] == "logz"
    assert hits[0].details["offset"] >= 10 - 1e-6  # the level: 10 nats from log V
    assert 1000 <= hits[0].step <= 1100  # |log Z − log V| passes 10 nats at step 1000
    # one event per window, not one per value
    assert all(b.step - a.step >= 10 * (DriftOptions().window - 1) for a, b in itertools.pairwise(hits))


def test_residual_advice_follows_norm_placement() -> None:
    for placement, expected in (("pre", "residual_growth_pre"), ("post", "residual_growth_post")):
        model = reference_gpt(vocab_size=256, norm_placement=placement)
        mon = stabkit.attach(model, None, config=stabkit.MonitorConfig(console=False, detect=None))
        handle = mon.install_detectors()
        rows = [(s, {"act/blocks.1/rms": 1.0 * 1.02**s}) for s in range(0, 400, 2)]
        handle.on_rows(rows)
        mon.detach()
        drifts = [e for e in mon.events if e.kind == "drift"]
        assert drifts and drifts[0].details["advice"] == expected
        assert "norm_placement" in drifts[0].details["interventions"]
        assert drifts[0].value >= 30.0  # residual_level: 30× the first values


def run_tiny(lr: float, steps: int) -> stabkit.Monitor:
    torch.manual_seed(0)
    model = reference_gpt(vocab_size=256)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95))
    mon = stabkit.attach(
        model, opt, config=stabkit.MonitorConfig(console=False, detect=None, every=5, log_every=50)
    )
    mon.install_detectors()
    for x, y in text_batches(steps, 4, 16, seed=3):
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        mon.step(loss)
    mon.detach()
    return mon


def test_real_high_lr_run_warns_about_attention_logits_and_a_low_lr_run_does_not() -> None:
    """Tiny GPT at LR 3e-2 (Wortsman-style attention-logit growth) against the same run at 1e-3."""
    hot = run_tiny(3e-2, 200)
    attn = [e for e in hot.events if e.kind == "drift" and e.where.startswith("attn/")]
    assert attn, [str(e) for e in hot.events]
    assert set(attn[0].details["interventions"]) == {"qk_clip", "qk_norm", "attn_softcap"}
    logits = [v for _, row in hot.history for k, v in row.items() if k.endswith("/max_logit")]
    assert max(logits) > 50  # the detector's level was really crossed in the measured series
    cold = run_tiny(1e-3, 200)
    assert [e for e in cold.events if e.kind == "drift"] == []


def residual_run(det: DriftDetector, loss_at: object, steps: int = 600) -> list[stabkit.Event]:
    """Residual RMS of blocks.0 growing 1 % per step from 1 (sampled every 10 steps), and the loss
    of every step from `loss_at(step)`; the drift events."""
    found = []
    for step in range(steps):
        det.update(step, "loss", loss_at(step))
        if step % 10 == 0:
            event = det.update(step, "act/blocks.0/rms", 1.01**step)
            if event is not None:
                found.append(event)
    return found


def test_growth_while_the_loss_falls_is_a_note_and_a_warning_once_it_stalls_or_passes_danger() -> None:
    """Llama + Muon grew its residual stream past the drift level while its loss fell to 1.94: a note.
    The same growth with a flat loss, or past the danger line, is a warning."""
    falling = residual_run(detector(), lambda t: 4.0 * math.exp(-t / 400) + 1.5)
    assert falling and all(e.severity == "info" for e in falling)
    assert falling[0].details["loss_falling"] and "while the loss still falls" in falling[0].message
    flat = residual_run(detector(), lambda t: 2.0 + 0.01 * math.sin(t))
    assert flat and flat[0].severity == "warning" and "stopped falling" in flat[0].message
    # the first events match: severity does not move when drift is found
    assert [e.step for e in flat][:1] == [e.step for e in falling][:1]
    # 1.01^t passes 300× its start (the danger line) at t ≈ 573: a warning while the loss still falls
    danger = residual_run(detector(), lambda t: 4.0 * math.exp(-t / 400) + 1.5, steps=800)
    late = [e for e in danger if e.value >= 300]
    assert late and all(e.severity == "warning" for e in late) and "danger line" in late[0].message
    # no loss at all (a monitor without the loss family): growth is a warning
    unknown = []
    det = detector()
    for step in range(0, 600, 10):
        if (event := det.update(step, "act/blocks.0/rms", 1.01**step)) is not None:
            unknown.append(event)
    assert unknown and unknown[0].severity == "warning"


def test_a_noisy_falling_loss_sampled_every_step_is_judged_over_loss_span() -> None:
    """Full mode samples every step, so a 20-value drift window spans 20 steps, where a healthy loss's
    noise hides its fall (the corpus's 8 false 'stopped falling' warnings). Judged over the last
    `loss_span` steps, the same loss falls: every event is a note."""
    rng = np.random.default_rng(0)
    noise = rng.normal(0.0, 0.15, 280)  # 1.02^t stays below the danger line (300× its start)

    def every_step(det: DriftDetector) -> list[stabkit.Event]:
        found = []
        for step in range(280):
            det.update(step, "loss", 4.0 * math.exp(-step / 400) + 1.5 + float(noise[step]))
            if (event := det.update(step, "act/blocks.0/rms", 1.02**step)) is not None:
                found.append(event)
        return found

    short = every_step(detector(loss_span=1))  # the drift's own 20-step window
    assert any(e.severity == "warning" and "stopped falling" in e.message for e in short)
    judged = every_step(detector())
    assert judged and [e.step for e in judged] == [e.step for e in short]
    assert all(e.severity == "info" and e.details["loss_falling"] for e in judged), [
        e.message for e in judged
    ]
