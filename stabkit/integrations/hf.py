"""`StabkitCallback` for the Hugging Face `transformers.Trainer` (extra: ``pip install stabkit[hf]``).

A thin adapter over `stabkit.attach`. When each part runs (transformers 5 order within a step:
backward per micro-batch, clip, `on_pre_optimizer_step`, `optimizer.step()`, `on_optimizer_step`,
`zero_grad`, `on_step_end`, `on_log`):

- `on_train_begin`: attach to the Trainer's model and to the torch optimizer inside its
  accelerate wrapper; the logdir defaults to ``<output_dir>/stabkit``;
- each training forward: a forward hook keeps the model's own loss (`outputs.loss`, present when
  the batch has labels) on the device — callbacks are not given the loss;
- `on_step_end` (once per optimizer step, also with gradient accumulation): `Monitor.step` with
  that step's loss, combined as the Trainer does (mean of micro-batches; a sum when the Trainer
  normalised each by `num_items_in_batch`, times the world size when it averages tokens across
  devices). With a `compute_loss_func` or label smoothing the model returns no loss: stabkit
  then logs no `loss` (the Trainer still logs its own);
- `on_train_end`: detach (flush and close the sinks).

Under torchrun (DDP / FSDP2 through accelerate) every rank runs the callback; rank 0 writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..discovery.trace import tracing
from ..distributed import process_group_active
from ..monitor import Monitor
from .session import Session


def output_loss(output: Any) -> Any:
    """The `loss` a transformers model returned (ModelOutput / dict key, or None)."""
    if isinstance(output, dict):
        return output.get("loss")
    return getattr(output, "loss", None)


class StabkitCallback(TrainerCallback):
    """Monitor a `transformers.Trainer` run with stabkit.

    `logdir`: where stabkit writes (default ``<output_dir>/stabkit``). Every other keyword
    (`config` — detectors and actions are `MonitorConfig.detect` —, `model_map`, `interventions`,
    `scaler`, ...) goes to `stabkit.attach` unchanged.
    """

    def __init__(self, logdir: str | Path | None = None, **attach_options: Any) -> None:
        self.session = Session(logdir, attach_options)
        self._hook: RemovableHandle | None = None
        self._world_scale = 1

    @property
    def monitor(self) -> Monitor | None:
        """The Monitor of the current or last run (detached after training; `history` and `events`
        stay readable); None before training starts."""
        return self.session.monitor

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: nn.Module | None = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        if model is None:
            raise ValueError("stabkit: the Trainer passed no model to on_train_begin")
        mon = self.session.start(
            model, optimizer, Path(args.output_dir or ".") / "stabkit", hf_schedule(args, state)
        )
        averaged = getattr(args, "average_tokens_across_devices", False) and process_group_active()
        self._world_scale = dist.get_world_size() if averaged else 1
        self._hook = mon.hooks.forward("hf-callback", mon.model, self._keep_loss, with_kwargs=True)

    def _keep_loss(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        """Forward hook: keep a training forward's loss (device tensor, no sync)."""
        if not (module.training and torch.is_grad_enabled()) or tracing():
            return
        loss = output_loss(output)
        if loss is None:
            return
        normalised = kwargs.get("num_items_in_batch") is not None
        self.session.add_loss(loss * self._world_scale if normalised else loss, summed=normalised)

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.session.step()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.session.stop()


def hf_schedule(args: Any, state: Any) -> dict[str, Any]:
    """The peak LR and warmup steps of a Trainer run (``learning_rate``; ``warmup_steps`` or
    ``warmup_ratio`` of ``max_steps``), for `attach`; {} where they cannot be read."""
    try:
        lr = float(args.learning_rate)
        warmup = int(args.get_warmup_steps(int(state.max_steps)))
    except Exception:  # an older or unusual TrainingArguments: the audit then says "not given"
        return {}
    return {"lr": lr if lr > 0 else None, "warmup_steps": max(0, warmup)}
