"""Which forwards are training forwards: the only ones whose statistics the forward probes record.

A *training forward* starts in training mode with gradients enabled. Not one: a validation forward
(``model.eval()`` and/or ``torch.no_grad()``), ``generate()`` (no_grad, KV cache), a ``no_grad``
forward between steps, and the recomputation activation checkpointing runs during backward (the
forward hooks of a checkpointed block fire again there). Nor is a forward whose input is an empty
batch (a tensor input with no element): its modules' statistics would be empty reductions; the
forward runs as it would without stabkit, unmeasured, and the first one is told once (a warning).

When it runs: the hooks of `TrainingForwards` run at the start and end of forwards of the model
and of the ancestors of its blocks and attention modules; `TrainingForwards.training` runs in the
probes' forward (pre-)hooks. No tensor work, no host sync.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..attach_checks import EMPTY_BATCH, empty_input
from ..hooks import DIRECT, Registrar, hook_warning


def in_backward() -> bool:
    """True while autograd's engine runs a backward pass on this thread: a forward seen now is an
    activation-checkpoint recomputation (reentrant or not). The signal FSDP2 and
    ``torch.utils.module_tracker`` use; inside a torch.compile trace it reads False."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


def ancestors(paths: Iterable[str]) -> list[str]:
    """The root ("") and every proper prefix of the module `paths`, outermost first."""
    out: dict[str, None] = {"": None}
    for path in paths:
        parts = path.split(".") if path else []
        for i in range(1, len(parts)):
            out[".".join(parts[:i])] = None
    return list(out)


class TrainingForwards:
    """Tells forward hooks whether the forward in progress is a training forward.

    Forward pre-hooks on the model and on the ancestors of `paths` (e.g. ``model`` and
    ``model.layers`` of a Hugging Face LM, ``model`` inside a LightningModule whose own forward is
    never called) record, when the outermost of them starts, ``training and torch.is_grad_enabled()``
    of that module; nested ones inherit it, and each forward hook (``always_call``) drops its entry.
    So a block run under reentrant checkpointing (whose first forward runs under ``no_grad``) still
    counts as training, while anything under backward (the recomputation) does not. A module called
    outside all of them falls back to its own ``training`` flag and the grad mode. The model's own
    pre-hook also reads the forward's inputs: an empty batch makes the forward not a training one
    (`stabkit.attach_checks.empty_input`). The hooks are installed while at least one probe uses
    them (`acquire` / `release`).
    """

    def __init__(
        self, model: nn.Module, paths: Iterable[str], hooks: Registrar = DIRECT, cadence: int | None = None
    ) -> None:
        self.model = model
        self.hooks = hooks
        self.cadence = cadence
        """The steps the probes' hooks act on (`StepPhase.any_every`): the hooks may be parked between
        them (`stabkit.hook_parking`); None: every step."""
        self.paths = ancestors(paths)
        self._stack: list[bool] = []
        self._users = 0
        self._handles: list[RemovableHandle] = []
        self._told_empty = False

    def acquire(self) -> None:
        """A probe starts relying on the hooks (at its attach); installs them on first use."""
        if self._users == 0:
            for path in self.paths:
                module = self.model.get_submodule(path)
                root = module is self.model
                self._handles.append(
                    self.hooks.forward_pre(
                        "training-forwards",
                        module,
                        self._enter_model if root else self._enter,
                        prepend=True,
                        with_kwargs=root,
                        cadence=self.cadence,
                    )
                )
                self._handles.append(
                    self.hooks.forward(
                        "training-forwards", module, self._exit, always_call=True, cadence=self.cadence
                    )
                )
        self._users += 1

    def release(self) -> None:
        """A probe detaches; the hooks go with the last user (safe to call too often)."""
        self._users = max(0, self._users - 1)
        if self._users == 0:
            for h in self._handles:
                h.remove()
            self._handles = []
            self._stack = []

    def _enter(self, module: nn.Module, args: Any) -> None:
        outer = self._stack[-1] if self._stack else module.training and torch.is_grad_enabled()
        self._stack.append(outer)

    def _enter_model(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """The model's own pre-hook: `_enter`, and an outermost training forward with an empty
        batch is not a training forward (warned once)."""
        self._enter(module, args)
        if len(self._stack) > 1 or not self._stack[-1]:  # nested, or not a training forward anyway
            return
        shape = empty_input(args, kwargs)
        if shape is not None:
            self._stack[-1] = False
            if not self._told_empty:
                self._told_empty = True
                hook_warning(EMPTY_BATCH.format(shape=shape), RuntimeWarning, stacklevel=3)

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._stack:  # empty when the pre-hook was installed during this very forward
            self._stack.pop()

    def training(self, module: nn.Module) -> bool:
        """True when the forward that runs `module` now is a training forward (call it where the
        grad mode is the forward's own, not under the probe's ``no_grad``)."""
        if in_backward():
            return False
        if self._stack:
            return self._stack[-1]
        return module.training and torch.is_grad_enabled()
