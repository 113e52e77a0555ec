"""The extension point of a detector that cannot decide from host values alone: its device part.

Most detectors judge host floats (`Detector.observe`). A kind whose decision needs the tensors
themselves — the non-finite check must see the model output, the gradients and the optimizer state
every step, and replay a step to name the module — declares a device part instead: its
`Detector.device_checks(ctx)` returns a `DeviceChecks` (or None), built once at attach from a
`DeviceContext`, the narrow device-side view the orchestration (`stabkit.decisions.Decisions`)
gives it. The built-in users are `stabkit.nonfinite.kind.NonfiniteDetector`
(`stabkit.nonfinite.watch.NonfiniteWatch`) and `stabkit.nonfinite.amp.AmpDetector` (with an fp16
GradScaler: `stabkit.nonfinite.scaler.ScalerCheck`).

When each method runs (every one has a no-op default; a part overrides what it needs):

| moment | method | returns |
|---|---|---|
| optimizer step pre-hook | `before_update` | a 0-d device flag to decide now, or None |
| same, after the one host copy | `decide_before_update` (only for a returned flag) | an event, or None |
| end of the pre-hook (always) | `pre_update_done` | — |
| optimizer step post-hook | `after_update` | — (device work only) |
| `Monitor.step` | `step_flags`, then `decide_step` with the names whose flag was set | flags; an event or None |
| each logged row (log interval) | `decide_row` | an event, or None |
| an event of its kind came from elsewhere | `noted` | — |
| end of `Monitor.step` | `end_step` | — |
| after the rows up to a step were judged | `forget_before` | — |

Flags are copied to the host with the step's other per-step values in one stacked copy (combined by
max across ranks); an event a part returns is advised by its kind's detector and acted on like any
other; the orchestration drops a part's event when an event of the same kind was already decided at
that step. Events from `before_update` act before the update (the step can still be skipped) and
stop that pre-hook's other decisions. Declarations only: importing this module loads no torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from ..detect_config import DetectConfig
from ..events import Event

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..hooks import Registrar
    from ..stats.step_facts import StepFacts

ValueOf = Callable[[str], "torch.Tensor | None"]
"""The step's recorded value of a series, as a device tensor (None when not recorded)."""


class Record(Protocol):
    """`DeviceContext.record`: add `value` under `name` to the step in progress; `every`: it is
    recorded on the steps of that cadence only (traced code computes it every step; the Recorder
    drops it on the others, `stabkit.stats.recorder.Recorder.add`)."""

    def __call__(self, name: str, value: torch.Tensor, every: int | None = None) -> None: ...


@dataclass(frozen=True)
class DeviceContext:
    """What a detector's device part may use (built once at attach by `stabkit.decisions`)."""

    model: nn.Module
    optimizer: Any | None
    """The optimizer (or `stabkit.optimizers.OptimizerSet`); None when attach got none."""
    config: DetectConfig
    hooks: Registrar
    """Where to register hooks (the Monitor's `HookSet`: listed, removed at detach)."""
    record: Record
    """Add a per-step flag to the step's statistics (combined by max over the step and across ranks)."""
    per_step: bool
    """Its kind is decided every step (`DetectConfig.needs_sync`); else at the log interval, from rows."""
    sampled_every: int
    """`MonitorConfig.every`: how often statistics are sampled."""
    can_replay: bool
    """Re-running the step's forward and backward on this rank alone is possible (not under torch.distributed)."""
    muted: Callable[[], contextlib.AbstractContextManager[Any]]
    """A context in which the probes' statistics go nowhere (for a replay's forward)."""
    facts: StepFacts = field(default_factory=lambda: _no_facts())
    """What the step knows (the Monitor's `StepFacts`, shared with the probes): the GradScaler and
    whether it skipped this step's update (read at `Monitor.step`), the after-update finiteness note."""
    output_site: tuple[str, Callable[[Any], Any]] | None = None
    """(path, take) of the module whose output holds the model's final logits, when discovery found
    one below the root (`ModelMap.logits`; `take(output)` reads them), else None. A check of the
    model output hooks there under torch.compile (a root hook with tensor work is a graph of its own)."""
    deep_every: int | None = None
    """`MonitorConfig.deep_cadence`: how often the whole-model checks run by default (None:
    `sampled_every`)."""
    step: Callable[[], int] | None = None
    """The index of the step in progress (completed `Monitor.step` calls; None: unknown, every step
    counts as due), for checks made on some steps only, read outside traced code."""

    @property
    def scaled(self) -> bool:
        """An enabled fp16 GradScaler is in use."""
        return self.facts.scaled


def _no_facts() -> StepFacts:
    """A `StepFacts` of its own for a context built without the Monitor's (tests); imported here, on
    use, so that reading the detectors' names does not import torch."""
    from ..stats.step_facts import StepFacts

    return StepFacts()


class DeviceChecks:
    """Base class of a detector's device part (see the module docstring for when each method runs)."""

    kind: str = ""
    """The kind of the events it returns (its detector's)."""

    def before_update(self, step: int, value: ValueOf, record: bool) -> torch.Tensor | None:
        """Optimizer step pre-hook (or `Monitor.step` when no pre-hook ran: ``record`` False, `value`
        reads the committed values): a 0-d device flag, non-zero when the step needs an event, to be
        decided now; None = nothing to decide now."""
        return None

    def decide_before_update(self, step: int, flagged: bool) -> Event | None:
        """The host value of the flag `before_update` returned: the event, or None."""
        return None

    def pre_update_done(self) -> None:
        """End of the step pre-hook, whatever happened in it (release what only it needed)."""

    def after_update(self, step: int) -> None:
        """Optimizer step post-hook: device work only (no host read)."""

    def step_flags(self, committed: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """At `Monitor.step`: (name, 0-d device flag) pairs to copy with the step's values."""
        return []

    def decide_step(self, step: int, flagged: list[str]) -> Event | None:
        """At `Monitor.step`, with the names of `step_flags` whose flag was set: the event, or None."""
        return None

    def decide_row(self, step: int, row: dict[str, float]) -> Event | None:
        """At the log interval, for each logged row in order: the event, or None."""
        return None

    def noted(self, event: Event) -> None:
        """An event of its kind was decided by another part at this step."""

    def end_step(self) -> None:
        """End of `Monitor.step`, after every decision of the step."""

    def forget_before(self, step: int) -> None:
        """The rows up to `step` were judged: drop what was kept for them."""

    def kept_forwards(self) -> list[Any]:
        """The step's kept forward calls, if it keeps them (the actions' ``ctx.forwards()``)."""
        return []

    def state_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready state for a checkpoint ({} = stateless)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""

    def detach(self) -> None:
        """Remove its hooks (safe twice)."""
