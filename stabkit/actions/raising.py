"""Action 'raise': after the event is reported, raise `stabkit.InstabilityError` carrying it."""

from __future__ import annotations

from ..events import Event, InstabilityError
from ..plugins import ACTIONS
from .base import Action


@ACTIONS.register
class Raise(Action):
    """Stop training with an exception (after the report, so the event is on disk)."""

    name = "raise"
    order = 90

    def run(self, event: Event, before_update: bool) -> bool:
        raise InstabilityError(event)
