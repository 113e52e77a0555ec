"""The handle every intervention returns, and the error raised when one cannot apply.

A handle is created at ``apply`` time and holds the undo steps of the surgery; ``remove()`` runs them
in reverse order and restores the model exactly (same parameter objects, same outputs). Removing
twice is safe; handles are context managers. The model remembers which interventions are active
(`active_interventions`) so the same one is not stacked twice and the monitor can log them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

_ACTIVE_ATTR = "_stabkit_interventions"


class InterventionError(ValueError):
    """An intervention cannot apply: names the intervention, the module path and what is missing.

    ``where`` is empty for errors in the request itself (unknown name or option, bad value)."""

    def __init__(self, intervention: str, where: str, missing: str) -> None:
        self.intervention = intervention
        self.where = where
        self.missing = missing
        text = (
            f"{intervention}: cannot apply to {where}: {missing}" if where else f"{intervention}: {missing}"
        )
        super().__init__(text)


class Handle:
    """Undo record of one or several applied interventions.

    - ``names``: the active intervention names it covers, in application order;
    - ``remove()``: restore the model (children in reverse order, then own undo steps in reverse);
    - ``metrics()``: latest values to log, ``{name: 0-d device tensor}`` (z_loss: ``logits/z_loss``);
    - ``new_parameters()``: parameters the intervention added (norm gains) — give them to the optimizer.
    """

    def __init__(self, model: nn.Module, names: Iterable[str], children: Iterable[Handle] = ()) -> None:
        self.model = model
        self.names: list[str] = list(names)
        self._children = list(children)
        self._undo: list[Callable[[], None]] = []
        self._params: list[nn.Parameter] = []
        self._metrics: Callable[[], dict[str, torch.Tensor]] | None = None
        self._removed = False
        self.counts: dict[str, int] = {}
        """Calls the intervention changed, per module path (host counters, no sync): what
        `stabkit.interventions.verify` checks after a forward."""
        self.refused: dict[str, str] = {}
        """Why a call at a module path was left unchanged (the latest reason; `kernel_change`): what
        `stabkit.interventions.verify` names when it refuses the intervention."""
        self.verifying = False
        """True during `stabkit.interventions.verify`'s traced forward: changed kernel calls are kept."""
        self.changed_calls: dict[str, Callable[[], tuple[float, float] | None]] = {}
        """Per module path, the backward check of the first kernel call changed there while verifying
        (`stabkit.interventions.backward_check`); emptied after the check."""

    # ---------------------------------------------------------------- building (apply time)
    def on_remove(self, undo: Callable[[], None]) -> None:
        """Register an undo step; steps run last-in first-out."""
        self._undo.append(undo)

    def add_parameters(self, params: Iterable[nn.Parameter]) -> None:
        """Record parameters this intervention created (they are already registered on the model)."""
        self._params.extend(params)

    def count(self, where: str) -> None:
        """Called by an intervention's forward-time handler each time it changes a call at `where`."""
        self.counts[where] = self.counts.get(where, 0) + 1

    def set_metrics(self, fn: Callable[[], dict[str, torch.Tensor]]) -> None:
        """Set the function that returns this intervention's latest metrics."""
        self._metrics = fn

    # ---------------------------------------------------------------- public
    @property
    def removed(self) -> bool:
        """True once `remove` ran."""
        return self._removed

    def metrics(self) -> dict[str, torch.Tensor]:
        """Latest metric values as detached 0-d device tensors (no host sync); empty when none."""
        out: dict[str, torch.Tensor] = {}
        if self._removed:
            return out
        for child in self._children:
            out.update(child.metrics())
        if self._metrics is not None:
            out.update(self._metrics())
        return out

    @property
    def children(self) -> list[Handle]:
        """The handles of the interventions this one covers (empty for a single intervention's)."""
        return list(self._children)

    def new_parameters(self) -> list[nn.Parameter]:
        """Parameters added to the model (e.g. QK-norm and sandwich-norm gains)."""
        params = [p for child in self._children for p in child.new_parameters()]
        return params + list(self._params)

    def remove(self) -> None:
        """Undo everything; the model is as before `apply`. Safe to call twice."""
        if self._removed:
            return
        self._removed = True
        errors: list[BaseException] = []
        for child in reversed(self._children):
            child.remove()
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as exc:  # keep undoing the rest, report afterwards
                errors.append(exc)
        if not self._children:
            for name in self.names:
                _forget(self.model, name, self)
        if errors:
            raise RuntimeError(f"removing {self.names} failed: {errors[0]!r}") from errors[0]

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else "active"
        return f"Handle({self.names}, {state})"


def active_interventions(model: nn.Module) -> dict[str, Handle]:
    """The interventions currently applied to `model`, name -> handle (a copy)."""
    return dict(model.__dict__.get(_ACTIVE_ATTR, {}))


def remember(model: nn.Module, name: str, handle: Handle) -> None:
    """Mark `name` active on `model` (called by `apply` after a successful application)."""
    model.__dict__.setdefault(_ACTIVE_ATTR, {})[name] = handle


def _forget(model: nn.Module, name: str, handle: Handle) -> None:
    active = model.__dict__.get(_ACTIVE_ATTR)
    if active is None or active.get(name) is not handle:
        return
    del active[name]
    if not active:
        del model.__dict__[_ACTIVE_ATTR]
