"""`LRFactor`: a learning-rate factor that holds whatever sets the learning rate between steps.

The 'rescue' action lowers the learning rate by its ``lr_factor``. Writing ``group["lr"] *= f`` once
does not survive a user's schedule: `torch.optim.lr_scheduler.LambdaLR`, `OneCycleLR` and any loop
that sets ``group["lr"]`` every step overwrite it at the next step (the rescue's factor is lost),
while schedulers that multiply the current value (`ExponentialLR`, `StepLR`) would carry it on.

So the factor lives outside the param groups and is applied inside each ``optimizer.step()``:

- a step pre-hook multiplies each group's ``lr`` by the factor just before the update (it keeps the
  value it found, and the one it wrote);
- a step post-hook puts the value it found back, for each group whose ``lr`` still holds the value
  the pre-hook wrote.

Between steps every group holds the learning rate its schedule set, so a scheduler reads and writes
only its own values — whatever it computes from (``base_lrs``, ``initial_lr``, the current ``lr``),
the factor is never compounded and never undone; an optimizer `state_dict()` taken between steps
holds the schedule's values. Statistics read inside the step (stabkit's update ratios, in the
gradient probe's post-hook, which runs before this one) see the learning rate actually used. A step
interrupted between the hooks (an exception in a later pre-hook) is repaired at the next pre-hook.

When it runs: the hooks run in every ``optimizer.step()`` while registered; with a factor of 1 they
change nothing.
"""

from __future__ import annotations

from typing import Any

from ..hooks import Registrar


class LRFactor:
    """Multiplies every param group's learning rate by `factor` during each optimizer step only."""

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        """A torch optimizer or a `stabkit.optimizers.OptimizerSet` (its groups are all of them)."""
        self.factor = 1.0
        """The factor in force (the product of every rescue's ``lr_factor``)."""
        self._scaled: list[tuple[dict[str, Any], Any, Any]] = []
        """(group, the lr it held, the lr written for the step) for the step in progress."""
        self._handles: list[Any] = []

    def attach(self, hooks: Registrar, owner: str) -> None:
        """Register the step pre- and post-hook through `hooks` (once, at attach: torch refuses a
        hook registered while its step runs its hooks)."""
        self._handles = [
            hooks.step_pre(owner, self.optimizer, self.before_step),
            hooks.step_post(owner, self.optimizer, self.after_step),
        ]

    @property
    def attached(self) -> bool:
        """True while its hooks are registered."""
        return bool(self._handles)

    def remove(self) -> None:
        """Take the hooks away and put the learning rates back (safe twice)."""
        self.restore()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def effective(self) -> list[float]:
        """The learning rate each group steps with now (its own × the factor)."""
        return [float(g["lr"]) * self.factor for g in self.optimizer.param_groups]

    def before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Step pre-hook: scale every group's ``lr`` for this step."""
        self.restore()  # a previous step that never reached its post-hook
        if self.factor == 1.0:
            return
        for group in self.optimizer.param_groups:
            found = group["lr"]
            scaled = found * self.factor  # a float, or a tensor (capturable / fused optimizers)
            group["lr"] = scaled
            self._scaled.append((group, found, scaled))

    def after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Step post-hook: give every group its own ``lr`` back."""
        self.restore()

    def restore(self) -> None:
        """Put back the learning rates the pre-hook scaled (a group whose ``lr`` was set anew since,
        or that is no longer in the optimizer, keeps what it has)."""
        for group, found, scaled in self._scaled:
            if group.get("lr") is scaled:
                group["lr"] = found
        self._scaled = []
