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

A re-warmup (`rewarm`, the rescue's ``rewarm_steps``) multiplies a second, passing factor in: at the
k-th optimizer step after it starts, ``start + (1 − start)·k / steps``, until it reaches 1 at step
`steps` — linear from a fraction back to the schedule, as Marin re-warmed its 32B run over 1000
steps after switching QK-norm on mid-run. Its progress is counted in the pre-hook.

When it runs: the hooks run in every ``optimizer.step()`` while registered; with a factor of 1 and
no re-warmup they change nothing.
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
        self._warm: tuple[int, float, int] | None = None
        """The re-warmup in progress: (steps, start fraction, steps done), or None."""

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
        """The learning rate each group steps with now (its own × the factor × the re-warmup's)."""
        factor = self.factor * self.warm_factor()
        return [float(g["lr"]) * factor for g in self.optimizer.param_groups]

    # ------------------------------------------------------------------ re-warmup
    def rewarm(self, steps: int, start: float) -> None:
        """Start a re-warmup: the next optimizer step runs at `start` × the rate, climbing linearly
        to the full rate at the `steps`-th step from now (replaces one in progress)."""
        self._warm = (int(steps), float(start), 0) if steps > 0 else None

    def warm_factor(self, ahead: int = 0) -> float:
        """The re-warmup's factor for the optimizer step `ahead` steps after the next one (1: none)."""
        if self._warm is None:
            return 1.0
        steps, start, done = self._warm
        return min(1.0, start + (1.0 - start) * (done + ahead) / steps)

    @property
    def warming(self) -> bool:
        """True while a re-warmup is in progress."""
        return self._warm is not None

    def warm_state(self) -> list[float]:
        """[steps, start, done] of the re-warmup in progress (for a checkpoint)."""
        assert self._warm is not None
        return [float(x) for x in self._warm]

    def load_warm_state(self, state: list[float]) -> None:
        steps, start, done = state
        self._warm = (int(steps), float(start), int(done))

    def before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Step pre-hook: scale every group's ``lr`` for this step."""
        self.restore()  # a previous step that never reached its post-hook
        factor = self.factor * self.warm_factor()
        if self._warm is not None:
            steps, start, done = self._warm
            self._warm = (steps, start, done + 1) if done + 1 < steps else None
        if factor == 1.0:
            return
        for group in self.optimizer.param_groups:
            found = group["lr"]
            scaled = found * factor  # a float, or a tensor (capturable / fused optimizers)
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
