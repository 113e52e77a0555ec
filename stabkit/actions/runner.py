"""`ActionRunner`: carries out the configured actions of each event, in order, and reports it.

Runs wherever an event is decided (see `stabkit.actions.base`). Order per event: the actions whose
`order` is below `REPORT_ORDER` (dump 10, rollback 20, skip 30, warn 40), then the update is
skipped if one of them asked for it (every gradient set to None), then the event is reported, then
the rest (raise 90). An event milder than `DetectConfig.act_on` ('warning' by default: a note) is
only reported.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..events import Event
from ..plugins import ACTIONS
from .base import REPORT_ORDER, Action, ActionContext
from .skip import skip_update


class ActionRunner:
    """One instance of each action the config uses, shared by every kind."""

    def __init__(self, ctx: ActionContext, report: Callable[[Event], None]) -> None:
        self.ctx = ctx
        self.report = report
        used = dict.fromkeys(a for acts in ctx.config.actions.values() for a in acts)
        self.actions: dict[str, Action] = {name: ACTIONS.load(name)(ctx) for name in used}

    def get(self, name: str) -> Action | None:
        """The instance of action `name`, when the config uses it."""
        return self.actions.get(name)

    def state_dict(self) -> dict[str, Any]:
        """The state of every action that keeps some, by name."""
        return {name: state for name, action in self.actions.items() if (state := action.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output (actions not used now are ignored)."""
        for name, action_state in state.items():
            if name in self.actions:
                self.actions[name].load_state_dict(action_state)

    def before_update(self, step: int) -> None:
        """Step pre-hook of a step on which no event acted: each action's periodic work."""
        for action in self.actions.values():
            action.before_update(step)

    def run(self, event: Event, before_update: bool) -> None:
        """Act on `event` (already carrying its advice) and report it."""
        names = self.ctx.config.actions.get(event.kind, ("warn",))
        if not self.ctx.config.acts_on(event.severity):  # a note is reported, never acted on
            names = tuple(n for n in names if n == "warn") or ("warn",)
        chosen = sorted((self.actions[n] for n in names if n in self.actions), key=lambda a: a.order)
        skip = False
        for action in (a for a in chosen if a.order < REPORT_ORDER):
            skip = action.run(event, before_update) or skip
        if skip and self.ctx.optimizer is not None:
            skip_update(self.ctx.optimizer)
            event.details["skipped_update"] = True
        event.details["actions"] = list(names)
        self.report(event)
        for action in (a for a in chosen if a.order >= REPORT_ORDER):
            action.run(event, before_update)
