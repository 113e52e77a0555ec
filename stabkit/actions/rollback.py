"""Action 'rollback': restore the newest in-memory snapshot taken at or before the event's step
(PaLM's recipe) and report which steps' batches were thereby skipped; before the update it also
skips it; the detectors forget what they saw of the steps rolled back (`Detector.rewind`). Snapshots are taken every ``snapshot_every`` steps in the step pre-hook of a step whose
checks passed (`stabkit.actions.snapshots`). Options: `SnapshotOptions`
(``DetectConfig.options["rollback"]``)."""

from __future__ import annotations

from ..events import Event
from ..plugins import ACTIONS
from .base import Action, ActionContext
from .snapshots import SnapshotOptions, SnapshotStore


@ACTIONS.register
class Rollback(Action):
    """Restore model and optimizer state from before the trouble."""

    name = "rollback"
    order = 20
    options_class = SnapshotOptions

    def __init__(self, ctx: ActionContext) -> None:
        super().__init__(ctx)
        self.snapshots = SnapshotStore.for_config(ctx.model, ctx.optimizer, ctx.config)

    def before_update(self, step: int) -> None:
        if self.snapshots.due(step):
            self.snapshots.take(step)

    def run(self, event: Event, before_update: bool) -> bool:
        snap = self.snapshots.newest_before(event.step)
        if snap is None:
            event.details["rollback"] = "no snapshot taken at or before this step yet"
            return before_update
        self.snapshots.restore(snap)
        self.ctx.rewound(snap.step)  # the detectors' windows forget the steps rolled back
        event.details["rollback"] = {
            "restored_step": snap.step,
            "skipped_steps": [snap.step, event.step],
            "note": (
                f"state restored to before step {snap.step}; the batches of steps {snap.step}..{event.step} "
                "are skipped (PaLM skipped 200–500 batches around each spike)"
            ),
        }
        return before_update
