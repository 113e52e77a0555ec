"""Change a known attention kernel's call (soft cap, q/k norm) only where its backward sees the change.

Used by the kernel handlers of ``attn_softcap`` and ``qk_norm``, which run inside the attention
module's forward, at each intercepted kernel call. A change is refused, and the call runs unchanged,
when it could not reach the backward (`stabkit.attention.kernels.hides_its_backward`: flash-attn's
forward op called inside its ``autograd.Function``) or when the kernel cannot take it (flash-attn
cannot soft-cap with dropout; the call caps already). A refusal is recorded on the handle — so the
apply-time check (`stabkit.interventions.verify`) raises an InterventionError naming the reason — and
said once per module in a warning during training, which goes on: a forward changed without its
backward would train on wrong gradients, an unchanged call trains right. While the apply-time check
runs (``handle.verifying``), the first call changed in each module is kept for its backward check
(`stabkit.interventions.backward_check`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..attention import kernels
from .backward_check import directional_error
from .handle import Handle


class KernelChange:
    """Applies one intervention's change to kernel calls, per attention module path."""

    def __init__(self, name: str, handle: Handle) -> None:
        self.name = name
        self.handle = handle
        self.grad_at_entry: dict[str, bool] = {}
        """Whether grad mode was on when each module's forward began (its scope's ``on_enter``)."""
        self._said: set[str] = set()

    def enter(self, path: str) -> None:
        """The scope's ``on_enter``: remember the module's grad mode (runs in its forward pre-hook)."""
        self.grad_at_entry[path] = torch.is_grad_enabled()

    def call(
        self,
        path: str,
        kernel: kernels.Kernel,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        change: Callable[[dict[str, Any]], None],
    ) -> Any:
        """Run the kernel call with `change` applied to its bound arguments (counted on the handle),
        or unchanged when the change is refused (recorded, warned once per module)."""
        bound = kernels.bind(kernel, fn, args, kwargs)
        if kernels.hides_its_backward(fn, self.grad_at_entry.get(path, False)):
            why = (
                f"{kernel.library}'s op {kernels.op_name(fn)} runs inside an autograd Function whose "
                "backward keeps the arguments it was given, so the change would reach the forward only; "
                "call the library's Python entry point (e.g. flash_attn_func) or make the change in the model"
            )
            return self._unchanged(path, why, fn, args, kwargs)
        try:
            change(bound.arguments)
        except ValueError as exc:
            return self._unchanged(path, str(exc), fn, args, kwargs)
        if self.handle.verifying and path not in self.handle.changed_calls:
            self.handle.changed_calls[path] = functools.partial(
                directional_error, kernel, fn, args, dict(kwargs), change
            )
        self.handle.count(path)
        return kernels.recall(fn, bound)

    def _unchanged(
        self, path: str, why: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        self.handle.refused[path] = why
        if path not in self._said:
            self._said.add(path)
            warnings.warn(
                f"stabkit: {self.name}: {path!r}: an attention call was left unchanged (forward and backward "
                f"as the kernel computes them): {why}",
                RuntimeWarning,
                stacklevel=3,
            )
        return fn(*args, **kwargs)
