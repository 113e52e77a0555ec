"""`Monitor.metrics` holds each step's values as soon as it is read, before any log interval, and the
sinks still get every step once (the read keeps the steps pending)."""

from __future__ import annotations

from pathlib import Path

import torch
from zoo import batch, lm_loss, reference_gpt

import stabkit
from stabkit.sinks import LOG_NAME, read_jsonl


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, mon: stabkit.Monitor, s: int) -> float:
    x, y = batch(s)
    loss = lm_loss(model(x), y)
    loss.backward()
    opt.step()
    mon.step(loss)
    opt.zero_grad()
    return float(loss.detach())


def test_metrics_hold_each_steps_values_before_the_log_interval(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = stabkit.MonitorConfig(every=2, log_every=50, console=False)
    mon = stabkit.attach(model, opt, logdir=tmp_path, config=cfg)
    losses = []
    seen_blocks: list[float] = []
    for s in range(5):
        losses.append(_step(model, opt, mon, s))
        assert mon.metrics["loss"] == losses[-1]  # this step's loss, long before step 50
        rms = [v for k, v in mon.metrics.items() if k.startswith("act/") and k.endswith("/rms")]
        if s == 0:
            assert rms  # step 0 is sampled (every=2): per-layer statistics at once
            seen_blocks = rms
        if s == 1:  # unsampled: the per-layer values stay those of step 0
            assert rms == seen_blocks
    assert len(mon.history) == 0  # history is filled per log interval (documented)
    mon.detach()
    rows = [r for r in read_jsonl(tmp_path / LOG_NAME) if r.get("type") == "metrics"]
    assert [r["values"]["loss"] for r in rows] == losses  # every step written once, reads changed nothing
    assert [r["step"] for r in rows] == list(range(5))


def test_a_loop_that_never_reads_metrics_copies_nothing_between_intervals(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mon = stabkit.attach(model, opt, config=stabkit.MonitorConfig(log_every=50, console=False))
    calls: list[int] = []
    real_peek = mon.recorder.peek
    mon.recorder.peek = lambda start=0: calls.append(start) or real_peek(start)  # type: ignore[method-assign]
    for s in range(3):
        _step(model, opt, mon, s)
    assert calls == [] and mon.recorder.pending_steps == 3
    assert "loss" in mon.metrics and calls == [0]
    assert "loss" in mon.metrics and calls == [0]  # a second read with no new step copies nothing
    _step(model, opt, mon, 3)
    assert mon.metrics["loss"] > 0 and calls == [0, 3]  # only the new step is copied
    mon.detach()
