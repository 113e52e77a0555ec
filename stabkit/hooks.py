"""`HookSet`: every hook stabkit puts on the user's model and optimizer goes through the Monitor's one
HookSet, which keeps the handles in registration order, removes them all at detach and can list them
(`Monitor.describe_hooks()`).

When it runs: plug-ins call it at attach (and the grad probe again when parameters are unfrozen);
the hooks themselves run inside the user's forward, backward and `optimizer.step()`. Every step
pre-hook registered here runs when the step's gradients are final (`AfterClosure`): before
``step`` updates anything, and after the closure's first call when ``step`` is given a closure.

Order at attach (the Monitor registers in this order, so hooks of the same event run in it too):
1. probes, in `stabkit.plugins.PROBES` order (activations, logits, gradients, attention, outliers): their
   forward hooks (the first one with forward hooks installs the training-forward markers,
   `stabkit.probes.forwards`, whose root pre-hook also finds an empty batch) and the gradient
   probe's optimizer step pre-/post-hooks;
2. the detectors' device checks (`stabkit.nonfinite`: step guard on the root's forward, tracer with
   ``per_module``) and `stabkit.decisions.Decisions`' optimizer step pre-/post-hooks — after the gradient probe's, so the step's gradient
   norm is recorded before it is judged;
3. integrations (e.g. the Hugging Face callback's loss hook), through `Monitor.hooks`.

Forward hooks registered with a ``cadence`` (they act only on steps that are multiples of it) may be
off their module between those steps (`stabkit.hook_parking`); the order above holds whenever they run.

`Registrar` is the same interface without bookkeeping, for code that changes the model on
purpose (interventions) rather than observing it.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .hook_parking import HookParking


class Registrar:
    """Registers hooks directly (the interface `HookSet` keeps track of)."""

    def _keep(self, owner: str, what: str, handle: RemovableHandle) -> RemovableHandle:
        return handle

    def _keep_forward(
        self, owner: str, what: str, handle: RemovableHandle, module: nn.Module, cadence: int | None
    ) -> RemovableHandle:
        return self._keep(owner, what, handle)

    def forward_pre(
        self,
        owner: str,
        module: nn.Module,
        fn: Callable[..., Any],
        *,
        prepend: bool = False,
        with_kwargs: bool = False,
        cadence: int | None = None,
    ) -> RemovableHandle:
        """`module.register_forward_pre_hook`. `cadence`: the hook acts only on steps that are a
        multiple of it (`COMPILED_ONLY`: only while torch.compile traces it); a `HookSet` may take it
        off the module between those steps (`stabkit.hook_parking`). None: it acts on every step."""
        handle = module.register_forward_pre_hook(fn, prepend=prepend, with_kwargs=with_kwargs)
        return self._keep_forward(
            owner, f"forward pre-hook on {type(module).__name__}", handle, module, cadence
        )

    def forward(
        self,
        owner: str,
        module: nn.Module,
        fn: Callable[..., Any],
        *,
        prepend: bool = False,
        with_kwargs: bool = False,
        always_call: bool = False,
        cadence: int | None = None,
    ) -> RemovableHandle:
        """`module.register_forward_hook` (`cadence`: as in `forward_pre`)."""
        handle = module.register_forward_hook(
            fn, prepend=prepend, with_kwargs=with_kwargs, always_call=always_call
        )
        return self._keep_forward(owner, f"forward hook on {type(module).__name__}", handle, module, cadence)

    def backward_pre(self, owner: str, module: nn.Module, fn: Callable[..., Any]) -> RemovableHandle:
        """`module.register_full_backward_pre_hook`."""
        handle = module.register_full_backward_pre_hook(fn)
        return self._keep(owner, f"backward pre-hook on {type(module).__name__}", handle)

    def backward(self, owner: str, module: nn.Module, fn: Callable[..., Any]) -> RemovableHandle:
        """`module.register_full_backward_hook`."""
        handle = module.register_full_backward_hook(fn)
        return self._keep(owner, f"backward hook on {type(module).__name__}", handle)

    def gradient(self, owner: str, param: torch.Tensor, fn: Callable[..., Any]) -> RemovableHandle:
        """`param.register_hook` (runs when the gradient w.r.t. `param` is computed)."""
        return self._keep(owner, "gradient hook on a parameter", param.register_hook(fn))

    def grad_accumulated(self, owner: str, param: torch.Tensor, fn: Callable[..., Any]) -> RemovableHandle:
        """`param.register_post_accumulate_grad_hook` (runs after `.grad` was updated)."""
        handle = param.register_post_accumulate_grad_hook(fn)
        return self._keep(owner, "post-accumulate-grad hook on a parameter", handle)

    def step_pre(self, owner: str, optimizer: Any, fn: Callable[..., Any]) -> RemovableHandle:
        """`optimizer.register_step_pre_hook`, with `fn` run when the step's gradients are final
        (`AfterClosure`: at once, or after the first call of a closure passed to ``step``)."""
        handle = optimizer.register_step_pre_hook(AfterClosure(fn))
        return self._keep(owner, "optimizer step pre-hook", handle)

    def step_post(self, owner: str, optimizer: Any, fn: Callable[..., Any]) -> RemovableHandle:
        """`optimizer.register_step_post_hook`."""
        return self._keep(owner, "optimizer step post-hook", optimizer.register_step_post_hook(fn))


class AfterClosure:
    """An optimizer step pre-hook that runs `fn(optimizer, args, kwargs)` once the step's gradients
    are final.

    When it runs: with ``optimizer.step()`` at once, before the update (a plain pre-hook). With
    ``optimizer.step(closure)`` — Lightning's every step, LBFGS-style loops — the gradients are
    made inside ``step`` by the closure (zero_grad, forward, backward), after the pre-hooks ran:
    the hook then hands ``step`` the same closure wrapped, and `fn` runs right after the closure's
    first call returns — still before the update, since every torch optimizer evaluates its
    closure before it changes a parameter. Later calls (LBFGS line-search evaluations) run the
    closure alone. The closure's result is returned unchanged; nothing else differs, so training
    is the same bit for bit. Wrapping costs a function object per step, and only with a closure.
    An optimizer that takes a closure but never calls it never runs `fn` that step.
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self, optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # torch passes `args` with the optimizer first: step(closure) gives (optimizer, closure)
        if kwargs.get("closure") is not None:
            return args, {**kwargs, "closure": self._then_fn(kwargs["closure"], optimizer, args, kwargs)}
        if len(args) > 1 and callable(args[1]):
            wrapped = self._then_fn(args[1], optimizer, args, kwargs)
            return (args[0], wrapped, *args[2:]), kwargs
        self.fn(optimizer, args, kwargs)
        return None

    def _then_fn(
        self, closure: Callable[[], Any], optimizer: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Callable[[], Any]:
        """`closure`, followed by `fn` after its first call."""
        pending = [True]

        def closure_then_hook() -> Any:
            out = closure()
            if pending:
                pending.clear()
                self.fn(optimizer, args, kwargs)
            return out

        return closure_then_hook


_DEFERRED: list[tuple[str, type[Warning]]] = []
"""Warnings raised by hooks while Dynamo traced them (`hook_warning`), until `flush_hook_warnings`."""


def hook_warning(message: str, category: type[Warning] = RuntimeWarning, stacklevel: int = 2) -> None:
    """Warn from inside a hook: at once in eager mode; under ``torch.compile`` (Dynamo cannot trace
    ``warnings.warn``: a graph break) the warning is kept and issued by `flush_hook_warnings` at the
    next `Monitor.step`."""
    if torch.compiler.is_compiling():
        _DEFERRED.append((message, category))
        return
    warnings.warn(message, category, stacklevel=stacklevel + 1)


def flush_hook_warnings() -> None:
    """Issue the warnings hooks deferred while compiled (at `Monitor.step`, eager)."""
    while _DEFERRED:
        message, category = _DEFERRED.pop(0)
        warnings.warn(message, category, stacklevel=3)


DIRECT = Registrar()
"""Hooks registered with no bookkeeping (model changes such as interventions)."""


class HookSet(Registrar):
    """The Monitor's hooks: kept in registration order, removed together (`remove`, safe twice).
    Forward hooks registered with a `cadence` are handed to `parking`, which takes them off their
    module between the steps they act on (eager only; `stabkit.hook_parking`)."""

    def __init__(self) -> None:
        self._handles: list[tuple[str, str, RemovableHandle]] = []
        self.parking = HookParking()

    def _keep(self, owner: str, what: str, handle: RemovableHandle) -> RemovableHandle:
        self._handles.append((owner, what, handle))
        return handle

    def _keep_forward(
        self, owner: str, what: str, handle: RemovableHandle, module: nn.Module, cadence: int | None
    ) -> RemovableHandle:
        if cadence is not None:
            handle = self.parking.track(module, handle, cadence)
        return self._keep(owner, what, handle)

    def describe(self) -> list[str]:
        """'owner: what' per registration, in order (hooks removed since then included)."""
        counts: dict[tuple[str, str], int] = {}
        for owner, what, _ in self._handles:
            counts[(owner, what)] = counts.get((owner, what), 0) + 1
        return [f"{owner}: {what}" + (f" ×{n}" if n > 1 else "") for (owner, what), n in counts.items()]

    def owners(self) -> list[str]:
        """Owners in the order they first registered a hook."""
        return list(dict.fromkeys(owner for owner, _, _ in self._handles))

    def remove(self, owner: str | None = None) -> None:
        """Remove the hooks of `owner` (every hook when None). Removing a handle twice is harmless."""
        self.parking.restore_all()
        kept = []
        for entry in self._handles:
            if owner is None or entry[0] == owner:
                entry[2].remove()
            else:
                kept.append(entry)
        self._handles = kept
