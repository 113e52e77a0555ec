"""`StabkitCallback` for Lightning (extra: ``pip install stabkit[lightning]``).

A thin adapter over `stabkit.attach`. When each part runs:

- `on_fit_start` (the strategy has set up the model and optimizers): attach to the
  LightningModule (or its sub-module `module`, e.g. ``"model"``) and `trainer.optimizers[0]`;
  the logdir defaults to ``<trainer.log_dir or default_root_dir>/stabkit``;
- `on_train_batch_end` (every batch): keep the batch's loss from `outputs` (Lightning divides it
  by `accumulate_grad_batches`, so the step's loss is their sum); when `trainer.global_step`
  moved (an optimizer step happened) call `Monitor.step` with that loss;
- `on_fit_end` / `on_exception`: detach (flush and close the sinks).

Lightning runs `training_step` and the backward inside ``optimizer.step(closure)``: stabkit's step
pre-hooks run after that closure (`stabkit.hooks.AfterClosure`), so the gradient norms are the
accumulated gradient's, as ``on_before_optimizer_step`` sees it (before Lightning clips it). When
discovery waits for the first forward (inside the closure), step 0 has gradient norms but no
update statistics.

Under torchrun or Lightning's DDP / FSDP strategies every rank runs the callback; rank 0 writes.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from ..monitor import Monitor
from .session import Session


class StabkitCallback(Callback):
    """Monitor a Lightning `Trainer.fit` run with stabkit.

    `logdir`: where stabkit writes. `module`: attribute path of the sub-module to monitor (None =
    the LightningModule itself; discovery finds blocks inside wrappers either way). Every other
    keyword (`config` — detectors and actions are `MonitorConfig.detect` —, `model_map`,
    `interventions`, `scaler`, ...) goes to `stabkit.attach` unchanged.
    """

    def __init__(
        self,
        logdir: str | Path | None = None,
        *,
        module: str | None = None,
        **attach_options: Any,
    ) -> None:
        self.session = Session(logdir, attach_options)
        self.module = module
        self._optimizer_steps = 0

    @property
    def monitor(self) -> Monitor | None:
        """The Monitor of the current or last run (detached after training; `history` and `events`
        stay readable); None before training starts."""
        return self.session.monitor

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        model = pl_module if self.module is None else pl_module.get_submodule(self.module)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        root = trainer.log_dir or trainer.default_root_dir
        self.session.start(model, optimizer, Path(root) / "stabkit")
        self._optimizer_steps = trainer.global_step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            self.session.add_loss(loss, summed=True)
        if trainer.global_step != self._optimizer_steps:
            self._optimizer_steps = trainer.global_step
            self.session.step()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.session.stop()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self.session.stop(crashed=True)
