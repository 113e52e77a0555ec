"""Action 'warn': nothing beyond the report every event gets (sinks print and log it)."""

from __future__ import annotations

from ..plugins import ACTIONS
from .base import Action


@ACTIONS.register
class Warn(Action):
    """Report only."""

    name = "warn"
