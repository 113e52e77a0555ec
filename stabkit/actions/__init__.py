"""Actions: what happens when a detector decides an event — warn, raise, skip, rollback, dump, or a
registered plug-in (`stabkit.plugins.ACTIONS`). See `stabkit.actions.base` for the shape of one."""

from .base import REPORT_ORDER, Action, ActionContext
from .runner import ActionRunner

__all__ = ["REPORT_ORDER", "Action", "ActionContext", "ActionRunner"]
