"""What an action plug-in is: something that happens when a detector decides an event.

An action gets an `ActionContext` (the model, the optimizer, the settings, and read-only views of
what the step kept) — never the Monitor. The runner (`stabkit.actions.runner.ActionRunner`) calls
the actions configured for the event's kind (`DetectConfig.actions`) in their `order`; the event is
reported (written to every sink) at `REPORT_ORDER`, so actions before it can add to
``event.details`` and actions after it (raise) see it logged.

When it runs: `run` in the optimizer's step pre-hook (``before_update=True``: non-finite values,
gradient-norm spikes — the update can still be skipped), at `Monitor.step` (after the update: loss
spikes, drift...) or at the log interval (warn-only kinds). `before_update(step)` runs in every
step pre-hook on which no event acted (e.g. rollback's periodic snapshot).

To add one: one file with a subclass, decorated with ``@stabkit.plugins.ACTIONS.register``; its
settings, if any, an options dataclass beside it named in ``options_class`` (read with
``ctx.config.options_for(self.name, TheOptions)``; ranges as `stabkit.tables.bounds` metadata).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from torch import nn

from ..detect_config import DetectConfig
from ..events import Event
from ..hooks import Registrar

REPORT_ORDER = 50
"""Position of 'report the event' among the actions of one event."""


@dataclass
class ActionContext:
    """What an action may use."""

    model: nn.Module
    optimizer: Any | None
    """The optimizer (or `stabkit.optimizers.OptimizerSet`); None when attach got none."""
    config: DetectConfig
    forwards: Callable[[], list[Any]]
    """The step's kept forward calls (`stabkit.nonfinite.guard.KeptForward`: inputs by reference,
    RNG and autocast state); empty when the non-finite step guard is off."""
    logdir: Callable[[], Path | None]
    """The folder the monitor writes to (a ``run-<n>`` subfolder when the logdir held a run)."""
    metrics: Callable[[], dict[str, float]]
    """The newest logged host value of every metric."""
    report: Callable[[Event], None] = lambda event: None
    """Record an event of the action's own (e.g. 'rescue') and write it to the sinks at once."""
    hooks: Registrar | None = None
    """Where to register hooks an action keeps (the Monitor's `HookSet`, under the action's name: listed
    by `Monitor.describe_hooks`, removed with the detectors); None outside a Monitor."""
    record: Callable[[str, Any], None] | None = None
    """Record a 0-d device statistic for the step in progress (``record(name, tensor)``: the Monitor's
    recorder, logged like the probes' metrics; no host sync); None outside a Monitor."""
    rewound: Callable[[int], None] = lambda step: None
    """Tell the detectors that model and optimizer were restored to before step `step` (rollback,
    rescue): their windows forget what came after it."""


class Action:
    """Base class of action plug-ins."""

    name: ClassVar[str] = ""
    """Registry name = the word used in `DetectConfig.actions`."""
    order: ClassVar[int] = 40
    """Position among the actions of one event (lower first); the report is at `REPORT_ORDER`."""
    options_class: ClassVar[type[Any] | None] = None
    """The dataclass of its settings (``DetectConfig.options[name]``, checked when the config is built);
    None: it takes none."""

    def __init__(self, ctx: ActionContext) -> None:
        self.ctx = ctx

    def run(self, event: Event, before_update: bool) -> bool:
        """Act on `event`; True asks the runner to skip the coming optimizer update."""
        return False

    def before_update(self, step: int) -> None:
        """In the step pre-hook of a step on which no event acted (after its checks passed)."""

    def state_dict(self) -> dict[str, Any]:
        """Plain state for a checkpoint (`Monitor.state_dict`); {} = stateless."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""
