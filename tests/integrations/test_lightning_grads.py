"""Under Lightning stabkit's gradient norms are the true ones at every optimizer step: equal to the
norm of the parameters' ``.grad`` measured in ``on_before_optimizer_step`` (the accumulated gradient,
before Lightning clips it), in automatic optimisation (whose backward runs inside
``optimizer.step(closure)``) with and without accumulation, and in manual optimisation with and
without a closure; the update norm equals ‖θ_new − θ_old‖; and a gradient spike reaches the spike
detector before the update (its 'skip' action leaves the parameters untouched)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from zoo import SEQ, VOCAB, lm_loss, reference_gpt

import stabkit

pl = pytest.importorskip("lightning.pytorch")

STEPS = 6


def config(detect: stabkit.DetectConfig | None) -> stabkit.MonitorConfig:
    """Per-layer statistics every step, nothing written out during the run; `detect` or the defaults."""
    quiet = stabkit.MonitorConfig(every=1, log_every=1000, console=False, audit=False)
    return quiet if detect is None else dataclasses.replace(quiet, detect=detect)


def grads_of(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in module.parameters() if p.grad is not None]


class Measured(pl.LightningModule):  # type: ignore[name-defined]
    """A tiny GPT that measures, per optimizer step, the true gradient norm (in
    `on_before_optimizer_step`) and ‖θ_new − θ_old‖ (at the end of the batch that stepped).

    `manual`: None (automatic optimisation), "closure" (``opt.step(closure=...)``, the backward
    in the closure) or "backward" (``manual_backward`` per batch, a step every `accumulate`).
    `spike_at`: the optimizer step whose loss is scaled by 1e4."""

    def __init__(self, manual: str | None = None, accumulate: int = 1, spike_at: int = -1) -> None:
        super().__init__()
        self.model = reference_gpt()
        self.manual = manual
        self.automatic_optimization = manual is None
        self.accumulate = accumulate
        self.spike_at = spike_at
        self.norms: list[float] = []
        self.block_norms: list[float] = []
        self.update_norms: list[float] = []
        self.stepped: list[bool] = []
        self._before: list[torch.Tensor] | None = None

    def loss(self, data: Any, index: int) -> torch.Tensor:
        x, y = data
        loss = lm_loss(self.model(x), y)
        return loss * 1e4 if index // self.accumulate == self.spike_at else loss

    def training_step(self, data: Any, index: int) -> torch.Tensor:
        if self.manual is None:
            return self.loss(data, index)
        opt = self.optimizers()
        if self.manual == "closure":

            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = self.loss(data, index)
                self.manual_backward(loss)
                return loss

            return opt.step(closure=closure)
        loss = self.loss(data, index) / self.accumulate
        self.manual_backward(loss)
        if (index + 1) % self.accumulate == 0:
            opt.step()
            opt.zero_grad()
        return loss

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.norms.append(float(torch.nn.utils.get_total_norm(grads_of(self))))
        self.block_norms.append(float(torch.nn.utils.get_total_norm(grads_of(self.model.blocks[1]))))
        self._before = [p.detach().clone() for p in self.parameters()]

    def on_train_batch_end(self, outputs: Any, batch: Any, index: int) -> None:
        if self._before is not None:  # this batch stepped
            after = [p.detach() for p in self.parameters()]
            deltas = [a - b for a, b in zip(after, self._before, strict=True)]
            self.update_norms.append(float(torch.nn.utils.get_total_norm(deltas)))
            self.stepped.append(any(bool((d != 0).any()) for d in deltas))
            self._before = None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(
    tmp_path: Path,
    lit: Measured,
    accumulate: int = 1,
    clip: float | None = None,
    detect: stabkit.DetectConfig | None = None,
) -> stabkit.Monitor:
    from stabkit.integrations.lightning import StabkitCallback

    torch.manual_seed(0)
    micro = STEPS * lit.accumulate * accumulate
    x = torch.randint(0, VOCAB, (2 * micro, SEQ + 1), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:]), batch_size=2)
    callback = StabkitCallback(config=config(detect))
    trainer = pl.Trainer(
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[callback],
    )
    trainer.fit(lit, data)
    assert callback.monitor is not None
    return callback.monitor


def series(mon: stabkit.Monitor, name: str, first: int = 0) -> list[float]:
    """The metric's value at steps first..STEPS-1 (every one must be there, and no other)."""
    got = {step: values[name] for step, values in mon.history if name in values}
    assert sorted(got) == list(range(first, STEPS)), (name, sorted(got))
    return [got[s] for s in range(first, STEPS)]


CASES: dict[str, tuple[str | None, int, float | None]] = {
    # (manual optimisation, the Trainer's accumulate_grad_batches, gradient_clip_val)
    "automatic": (None, 1, None),
    # Lightning clips after on_before_optimizer_step: stabkit's norm is the one before clipping too
    "automatic-accumulate-2-clipped": (None, 2, 0.05),
    "manual-closure": ("closure", 1, None),
    "manual-accumulate-2": ("backward", 1, None),
}
"""Where the first forward runs inside ``optimizer.step(closure)`` (automatic without accumulation,
a manual closure) the monitor attaches during step 0 (discovery waits for that forward): step 0 has
its gradient norms, not its update statistics (no parameters were kept before its update)."""


@pytest.mark.parametrize("case", list(CASES))
def test_lightning_gradient_and_update_norms_are_the_true_ones(tmp_path: Path, case: str) -> None:
    manual, accumulate, clip = CASES[case]
    lit = Measured(manual=manual, accumulate=2 if manual == "backward" else 1)
    mon = fit(tmp_path, lit, accumulate=accumulate, clip=clip)
    assert len(lit.norms) == STEPS and mon.global_step == STEPS
    assert series(mon, "grad/global_norm") == pytest.approx(lit.norms, rel=1e-5)
    assert series(mon, "grad/model.blocks.1/norm") == pytest.approx(lit.block_norms, rel=1e-5)
    first = 1 if accumulate == 1 and manual != "backward" else 0
    assert series(mon, "update/norm", first) == pytest.approx(lit.update_norms[first:], rel=1e-4)
    if clip is not None:  # the clip did act, so a norm read after it would differ
        assert min(lit.norms) > 2 * clip


def test_lightning_gradient_spike_is_judged_before_the_update(tmp_path: Path) -> None:
    """An injected 1e4× loss at step 4 (automatic optimisation: the backward inside the closure): the
    spike detector sees ``grad/global_norm`` before the update and its 'skip' action leaves every
    parameter as it was; the other steps update."""
    spike_at = 4
    lit = Measured(spike_at=spike_at)
    detect = stabkit.DetectConfig(
        detectors=("spike",),
        actions={"spike": "skip"},
        options={"spike": {"min_history": 3, "window": 8}},
        act_on="info",  # a gradient spike alone is a note: act on its first sign, as recipes do
    )
    mon = fit(tmp_path, lit, detect=detect)
    hits = [e for e in mon.events if e.kind == "spike" and e.where == "grad/global_norm"]
    assert [e.step for e in hits] == [spike_at], [(e.step, e.where) for e in mon.events]
    assert lit.stepped == [s != spike_at for s in range(STEPS)]
