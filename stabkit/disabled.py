"""`DisabledMonitor`: what `stabkit.attach` returns under ``STABKIT_DISABLE=1`` (`stabkit.environment`).

It has the Monitor's API — `step`, `detach`, `flush`, the context manager, `metrics`, `history`,
`events`, `state_dict` — and does nothing: no hook on the model or optimizer, no discovery, no audit,
no sink, no file, no intervention. `step` only counts steps, so `global_step` and a checkpoint's
`state_dict` stay meaningful. Built at attach; costs nothing per step but one integer increment.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict, deque
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .config import MonitorConfig
from .distributed.context import SINGLE
from .events import Event
from .hooks import HookSet
from .incidents import IncidentLog
from .monitor import Monitor
from .sinks import SinkSet
from .stats import Recorder


class NoHooks(HookSet):
    """A HookSet that registers nothing: integrations that add hooks through `Monitor.hooks` (the
    Hugging Face callback's loss hook) get a handle that removes nothing."""

    def _none(self, *args: Any, **kwargs: Any) -> RemovableHandle:
        return RemovableHandle(OrderedDict())  # a dict of hooks nobody calls (weak-referenceable)

    forward_pre = forward = backward_pre = backward = _none
    gradient = grad_accumulated = step_pre = step_post = _none


class DisabledMonitor(Monitor):
    """A Monitor that watches nothing (``STABKIT_DISABLE=1``); see the module notes."""

    watches_nothing = True
    """Read by `stabkit.monitor_repr` (which does not import this module: it would import it back)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        config: MonitorConfig | None = None,
        interventions: Any = None,
    ) -> None:
        if interventions:
            warnings.warn(
                f"stabkit: STABKIT_DISABLE is set, so the interventions asked of attach ({interventions!r}) "
                "are not switched on either: this run trains the model as it is",
                stacklevel=3,
            )
        self.model = model
        self.optimizer: Any = optimizer
        self.config = config or MonitorConfig()
        self.logdir = None
        self.interventions = None
        self.scaler = None
        self.schedule = {"lr": None, "warmup_steps": None}
        self._metrics: dict[str, float] = {}
        self.history: deque[tuple[int, dict[str, float]]] = deque(maxlen=self.config.history)
        self.events: list[Event] = []
        self.incidents = IncidentLog()
        self.hooks = NoHooks()
        self.probes = []
        self.detectors = None
        self.audit_report = None
        self.sinks = SinkSet(None, tensorboard=False, jsonl=False, console=False)
        self.flush_every_step = False
        self._step = 0
        self._detached = False
        self._model_map = None
        self.dist = SINGLE
        self.recorder = Recorder()  # stays empty

    @property
    def model_map(self) -> Any:
        """No discovery ran: always a RuntimeError."""
        raise RuntimeError("stabkit: monitoring is off (STABKIT_DISABLE is set): no model map")

    @property
    def metrics(self) -> dict[str, float]:
        """Always empty: nothing is measured."""
        return self._metrics

    def step(self, loss: torch.Tensor | float | None = None) -> None:
        """Count the step (no statistic, no sync)."""
        if self._detached:
            raise RuntimeError("Monitor.step() called after detach(); attach again to keep monitoring")
        self._step += 1

    def flush(self) -> None:
        """Nothing to write."""

    def report(self, event: Event) -> None:
        """Keep an event reported by hand in `events` (nothing is written)."""
        self.events.append(event)

    def write_text(self, tag: str, text: str) -> None:
        """Nothing is written."""

    def install_detectors(self, config: Any = None) -> Any:
        """No detectors while monitoring is off: returns None."""
        return None

    def detach(self) -> None:
        """Mark the monitor detached (there is nothing to remove). Safe to call twice."""
        self._detached = True

    def close_on_crash(self) -> None:
        self.detach()

    def _local_only(self) -> None:
        """Nothing pending."""

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.detach()
