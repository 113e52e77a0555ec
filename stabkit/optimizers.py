"""Several optimizers seen as one: `attach(model, [opt1, opt2])` (e.g. a second optimizer for the
embeddings, or Muon for matrices and AdamW for the rest).

`OptimizerSet` is what the monitor, probes and detectors see instead of one optimizer: the param
groups of all of them, one state mapping, and step hooks that fire once per training step — the
pre-hook before the first optimizer steps (so a skip decision stops *every* optimizer), the
post-hook after the last one stepped (so update ratios see every update). `Monitor.step` closes the
step (`end_step`), and runs a post-hook that has not fired (an optimizer that did not step).

Created once at attach; the hooks run inside each optimizer's ``step()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

import torch

StepHook = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]


class _StateView(MutableMapping[torch.Tensor, dict[str, Any]]):
    """The optimizers' `state` dicts as one mapping parameter -> state (routed to the owner)."""

    def __init__(
        self, owner: Callable[[torch.Tensor], torch.optim.Optimizer | None], optimizers: list
    ) -> None:
        self._owner = owner
        self._optimizers = optimizers

    def __getitem__(self, p: torch.Tensor) -> dict[str, Any]:
        opt = self._owner(p)
        if opt is None:
            raise KeyError(p)
        return opt.state[p]  # a defaultdict: created on first access, as torch does

    def __setitem__(self, p: torch.Tensor, value: dict[str, Any]) -> None:
        opt = self._owner(p)
        if opt is None:
            raise KeyError(p)
        opt.state[p] = value

    def __delitem__(self, p: torch.Tensor) -> None:
        opt = self._owner(p)
        if opt is None or p not in opt.state:
            raise KeyError(p)
        del opt.state[p]

    def __iter__(self) -> Iterator[torch.Tensor]:
        for opt in self._optimizers:
            yield from opt.state

    def __len__(self) -> int:
        return sum(len(opt.state) for opt in self._optimizers)

    def __contains__(self, p: object) -> bool:
        return any(p in opt.state for opt in self._optimizers)


class OptimizerSet:
    """Several `torch.optim.Optimizer` objects with the interface the monitor uses (see the module
    docstring). Not an optimizer itself: call each one's ``step()`` as before."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)
        self.state = _StateView(self.owner, self.optimizers)
        self._pre: list[StepHook] = []
        self._post: list[StepHook] = []
        self._stepped: set[int] = set()
        self._pre_done = False
        self._post_done = False
        self._handles = [
            h
            for opt in self.optimizers
            for h in (opt.register_step_pre_hook(self._on_pre), opt.register_step_post_hook(self._on_post))
        ]

    # ------------------------------------------------------------------ what the monitor reads
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every optimizer's param groups, in order (a fresh list: add groups with `add_param_group`)."""
        return [g for opt in self.optimizers for g in opt.param_groups]

    def owner(self, p: torch.Tensor) -> torch.optim.Optimizer | None:
        """The optimizer that holds `p` (None when none does)."""
        for opt in self.optimizers:
            if any(q is p for g in opt.param_groups for q in g["params"]):
                return opt
        return None

    def add_param_group(self, group: dict[str, Any]) -> None:
        """Add a group to the first optimizer (stabkit's interventions add their new gains here)."""
        self.optimizers[0].add_param_group(group)

    def remove_param_group(self, group: dict[str, Any]) -> None:
        """Take `group` (an object from `param_groups`) out of whichever optimizer holds it."""
        for opt in self.optimizers:
            opt.param_groups[:] = [g for g in opt.param_groups if g is not group]

    def state_dict(self) -> dict[str, Any]:
        """Each optimizer's state_dict, in order."""
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        for opt, sd in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(sd)

    # ------------------------------------------------------------------ one step, several optimizers
    def register_step_pre_hook(self, hook: StepHook) -> Any:
        """`hook(self, args, kwargs)` once per training step, before the first optimizer steps."""
        return _ListHandle(self._pre, hook)

    def register_step_post_hook(self, hook: StepHook) -> Any:
        """`hook(self, args, kwargs)` once per training step, after the last optimizer stepped."""
        return _ListHandle(self._post, hook)

    def _on_pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> Any:
        """A pre-hook may return new (args, kwargs) for ``step`` (`stabkit.hooks.AfterClosure` wraps a
        closure): they are passed on to the next hook and returned to torch."""
        if self._pre_done:
            return None
        self._pre_done = True
        changed = False
        for hook in list(self._pre):
            result = hook(self, args, kwargs)
            if result is not None:
                args, kwargs = result
                changed = True
        return (args, kwargs) if changed else None

    def _on_post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._stepped.add(id(opt))
        if len(self._stepped) == len(self.optimizers):
            self._run_post()

    def _run_post(self) -> None:
        if not self._post_done and self._pre_done:
            self._post_done = True
            for hook in list(self._post):
                hook(self, (), {})

    def end_step(self) -> None:
        """At `Monitor.step`: finish this step (a post-hook still due runs now) and start the next."""
        self._run_post()
        self._stepped.clear()
        self._pre_done = self._post_done = False

    def remove(self) -> None:
        """Remove the hooks on the optimizers (safe twice)."""
        while self._handles:
            self._handles.pop().remove()


class _ListHandle:
    """A removable entry in a plain list of hooks (what `register_step_*_hook` returns)."""

    def __init__(self, hooks: list[StepHook], hook: StepHook) -> None:
        self._hooks = hooks
        self._hook = hook
        hooks.append(hook)

    def remove(self) -> None:
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


def as_optimizer(optimizer: Any) -> Any:
    """What `attach` takes as `optimizer`: None, one optimizer, or several (a list/tuple) -> an
    OptimizerSet. Raises TypeError for anything else."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if isinstance(optimizer, list | tuple) and optimizer:
        bad = [type(o).__name__ for o in optimizer if not isinstance(o, torch.optim.Optimizer)]
        if bad:
            raise TypeError(f"stabkit.attach: every optimizer must be a torch.optim.Optimizer, got {bad}")
        return optimizer[0] if len(optimizer) == 1 else OptimizerSet(optimizer)
    raise TypeError(
        "stabkit.attach: optimizer must be a torch.optim.Optimizer, a list of them, or None; "
        f"got {type(optimizer).__name__}"
    )
