"""`attach`: the one call that starts monitoring a model (a `Monitor`, or a `DisabledMonitor` when
``STABKIT_DISABLE=1``). Its own module so that `stabkit.monitor` and `stabkit.disabled` (a Monitor
subclass) do not import each other. Runs once, before training."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import MonitorConfig
from .disabled import DisabledMonitor
from .discovery import ModelMap
from .environment import disabled, env_logdir
from .monitor import InterventionSpecs, Monitor


def attach(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    *,
    logdir: str | Path | None = None,
    config: MonitorConfig | None = None,
    model_map: ModelMap | dict[str, Any] | None = None,
    interventions: InterventionSpecs | None = None,
    scaler: torch.amp.GradScaler | None = None,
    example: Any = None,
    lr: float | None = None,
    warmup_steps: int | None = None,
) -> Monitor:
    """Attach stabkit to `model` (and `optimizer`, or a list of optimizers): hooks on, statistics to `logdir`.

    Call `Monitor.step(loss)` once per training step and `Monitor.detach()` at the end (or use
    the monitor as a context manager). Discovery traces one forward (see `stabkit.inspect_model`): on
    `example` when given, else on a small input stabkit makes for token and image models, else on
    the first forward the model runs (the monitor then finishes attaching right before it).
    `model_map` overrides discovery (a ModelMap or a dict of hints). A `logdir` that already holds a
    run's logs is not mixed into: the run writes to ``<logdir>/run-<n>`` (`Monitor.logdir` names it;
    `MonitorConfig.logdir_mode` chooses 'append' or 'overwrite' instead). With fp16 and a `torch.amp.GradScaler`, pass it as `scaler` so
    gradient norms are unscaled and skipped steps are reported as `amp/overflow`. `interventions` switches fixes on first (e.g.
    ``["qk_norm", ("z_loss", {"coef": 1e-4})]``); `detach` switches them off again. `lr` and
    `warmup_steps`: the run's peak learning rate and warmup, when known — the audit at attach and the
    detectors use them (post-norm without warmup is flagged when the warmup is 0 or not given).
    ``STABKIT_DISABLE=1`` returns a `stabkit.disabled.DisabledMonitor` (same API, nothing hooked);
    ``STABKIT_LOGDIR`` is the logdir when `logdir` is None (`stabkit.environment`).
    """
    if disabled():
        return DisabledMonitor(model, optimizer, config, interventions)
    logdir = env_logdir(logdir)
    return Monitor(
        model,
        optimizer,
        logdir=logdir,
        config=config,
        model_map=model_map,
        interventions=interventions,
        scaler=scaler,
        example=example,
        lr=lr,
        warmup_steps=warmup_steps,
    )
