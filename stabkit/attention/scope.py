"""See (and change) the torch functions an attention module calls, only while that module runs.

Fused attention (``F.scaled_dot_product_attention``) never materialises the logits, and eager
attention computes them inline; both are reachable through a ``torch.overrides.TorchFunctionMode``.
A mode left active for a whole forward pass sees every op (8–15 % of step time on a CPU GPT), so
this module keeps it narrow: `attach_scope` pushes a `ScopedFunctionMode` in the attention module's
forward pre-hook and pops it in its forward hook (``always_call=True``: popped on errors too).

Several scopes may be attached to the same module. Inside a mode's handler the mode itself is
off, so a call the handler passes on goes to the next mode *outwards*; the innermost mode (pushed
last) sees the call first. Two roles follow:

- ``outer=True`` — a *changer* (soft capping): pre-hook prepended, post-hook appended, so it is pushed
  first and popped last, and sees the call after every observer;
- ``outer=False`` — an *observer* (the attention probe): pre-hook appended, post-hook prepended, so it
  is innermost and sees the raw call before any changer rewrites it.

Hooks run in the forward pass of the attention module; the handlers run where the module calls the
intercepted function. Nothing here syncs with the device.

Under ``torch.compile`` Dynamo traces the push and the pop (a `TorchFunctionMode`'s ``__enter__`` /
``__exit__``) and every torch call the module makes while the mode is active goes through the mode's
``__torch_function__`` at trace time: the handlers' work becomes part of the graph and the compiled
code carries no mode at all (no per-op cost at run time). Whether the mode is pushed is decided in
the pre-hook by ``enabled()`` — a stable Python value per step kind (`stabkit.probes.base.StepPhase`),
so sampled and unsampled forwards are two graphs, each compiled once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..hooks import DIRECT, Registrar

Handler = Callable[[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]
"""handler(path, func, args, kwargs) -> result. Call ``func(*args, **kwargs)`` to pass the call on."""

OnExit = Callable[[str, int, Any], None]
"""on_exit(path, handled_calls, output) after the module's forward; output is None when forward raised."""

SDPA: Callable[..., Any] = torch.nn.functional.scaled_dot_product_attention
SOFTMAXES: tuple[Callable[..., Any], ...] = (
    torch.nn.functional.softmax,
    torch.softmax,
    torch.Tensor.softmax,
)
"""The softmax entry points eager attention uses (HF eager: ``nn.functional.softmax``)."""


class ScopedFunctionMode(TorchFunctionMode):
    """Forwards selected torch functions to handlers, tagged with the running module's path.

    Every other function passes straight through. ``handled`` counts the intercepted calls.
    """

    def __init__(
        self,
        path: str,
        functions: Mapping[Callable[..., Any], Handler],
        resolve: Callable[[Any], Handler | None] | None = None,
    ) -> None:
        super().__init__()
        self.path = path
        self.functions = functions
        self.resolve = resolve
        """Handler for a function not in `functions` (known attention kernels by op name), or None."""
        self.handled = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        handler = self.functions.get(func)
        if handler is None and self.resolve is not None:
            handler = self.resolve(func)
        if handler is None:
            return func(*args, **kwargs)
        self.handled += 1
        return handler(self.path, func, args, kwargs)


def _pop(mode: TorchFunctionMode) -> None:
    """Pop `mode` from the torch-function mode stack, keeping any modes pushed above it (if a module
    below pushed a mode and never popped it); when `mode` is not on the stack, nothing changes.
    Traced by Dynamo (which keeps the mode stack itself): the mode's own ``__exit__``."""
    if torch.compiler.is_compiling():
        mode.__exit__(None, None, None)
        return
    above: list[Any] = []
    while torch._C._len_torch_function_stack() > 0:
        top = torch._C._pop_torch_function_stack()
        if top is mode:
            break
        above.append(top)
    for other in reversed(above):
        torch._C._push_on_torch_function_stack(other)


class ScopeHandle:
    """Removes the hooks of one `attach_scope` call. Safe to call twice; a context manager."""

    def __init__(self, handles: list[Any], paths: list[str]) -> None:
        self._handles = handles
        self.paths = paths

    def remove(self) -> None:
        """Detach all push/pop hooks. Call between forward passes: a mode pushed by a forward that is
        still running would not be popped."""
        while self._handles:
            self._handles.pop().remove()

    def __enter__(self) -> ScopeHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def attach_scope(
    model: nn.Module,
    paths: Sequence[str],
    functions: Mapping[Callable[..., Any], Handler],
    *,
    outer: bool,
    on_exit: OnExit | None = None,
    enabled: Callable[[], bool] | None = None,
    hooks: Registrar = DIRECT,
    owner: str = "attention-scope",
    resolve: Callable[[Any], Handler | None] | None = None,
    on_enter: Callable[[str], None] | None = None,
    cadence: int | None = None,
) -> ScopeHandle:
    """While each module at `paths` (``named_modules`` paths in `model`) runs, route the calls of
    `functions` to their handlers. `outer` picks the hook order (see the module docstring).

    `enabled` (optional) is asked in each pre-hook; when it returns False the mode is not pushed
    for that forward (e.g. a probe sampling only some steps). `on_exit` runs after each scoped
    forward with the number of calls handled. `hooks` registers the two hooks per module (a monitor's
    `HookSet` for probes). `resolve` picks a handler for functions not in `functions` (known attention
    kernels, by op name: `stabkit.attention.kernels.lookup`). `on_enter(path)` runs in each pre-hook
    that pushes the mode (an intervention notes the module's grad mode). `cadence`: `enabled` is True
    only on steps that are multiples of it (a monitor's `HookSet` may park the hooks between them:
    `stabkit.hook_parking`). Returns a handle that removes the hooks.
    """
    handles: list[Any] = []
    for path in paths:
        module = model.get_submodule(path)
        stack: list[ScopedFunctionMode | None] = []

        def pre_hook(
            mod: nn.Module,
            args: Any,
            _path: str = path,
            _stack: list[ScopedFunctionMode | None] = stack,
        ) -> None:
            if enabled is not None and not enabled():
                _stack.append(None)
                return
            if on_enter is not None:
                on_enter(_path)
            mode = ScopedFunctionMode(_path, functions, resolve)
            mode.__enter__()
            _stack.append(mode)

        def post_hook(
            mod: nn.Module,
            args: Any,
            output: Any,
            _path: str = path,
            _stack: list[ScopedFunctionMode | None] = stack,
        ) -> None:
            if not _stack:  # our pre-hook never ran (an earlier pre-hook raised)
                return
            mode = _stack.pop()
            if mode is None:
                return
            _pop(mode)
            if on_exit is not None:
                on_exit(_path, mode.handled, output)

        handles.append(hooks.forward_pre(owner, module, pre_hook, prepend=outer, cadence=cadence))
        handles.append(
            hooks.forward(owner, module, post_hook, prepend=not outer, always_call=True, cadence=cadence)
        )
    return ScopeHandle(handles, list(paths))
