"""Known attention kernels: what each is called, how to read q and k from a call, how to cap it.

A `Kernel` names its entry points — torch ops by qualified name (``flash_attn::_flash_attn_forward``,
a ``torch.library.custom_op``, a higher-order op such as ``higher_order::flex_attention``) and
Python functions or module forwards by import path (``xformers.ops.fmha:memory_efficient_attention``)
— and a reader that turns one call's bound arguments into a canonical `QKCall`.

A ``TorchFunctionMode`` sees every torch op call made while it is active (as an ``OpOverloadPacket``,
``OpOverload`` or higher-order op); Python entry points become visible the same way once
`stabkit.attention.kernels.entry_points` has wrapped them. `lookup(func)` is what the attention
probe's scope, discovery's traced forward and the interventions ask for each function they see:
it runs inside forwards, so it is a dict lookup (plus a type check for ops).

Registration happens at import (the built-in kernels) or from user code (`register_kernel`); nothing
here imports the kernel libraries themselves.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..call import QKCall

Reader = Callable[[Mapping[str, Any]], QKCall]
"""bound arguments (by parameter name, defaults filled in) -> the canonical call."""
CapRewrite = Callable[[dict[str, Any], float], None]
"""Set the kernel's own soft cap to `cap` in the bound arguments, in place (or raise ValueError)."""
QKMap = Callable[[torch.Tensor], torch.Tensor]
QKRewrite = Callable[[dict[str, Any], QKMap, QKMap], None]
"""Replace q by f(q) and k by g(k) in the bound arguments, in place (or raise ValueError)."""


@dataclass(frozen=True)
class Kernel:
    """One attention kernel stabkit can read (and, with `cap`, soft-cap through its own argument)."""

    name: str
    """Short name, used in metric notes and messages (``flash_attn``, ``flex_attention``)."""
    library: str
    """Human name of the library (``flash-attn 2``)."""
    read: Reader
    ops: tuple[str, ...] = ()
    """Qualified torch op names (``namespace::name``) that are this kernel."""
    functions: tuple[str, ...] = ()
    """Python entry points, ``module:qualname`` (``Class.forward`` for a module's forward)."""
    params: tuple[str, ...] = ()
    """Parameter names, for entry points without a schema or signature stabkit can read (higher-order ops)."""
    cap: CapRewrite | None = None
    """How to soft-cap through the kernel's own argument; None when the kernel has none."""
    qk: tuple[str, str] = ("q", "k")
    """Names of the query and key arguments (their last dim is the head dim, whatever the layout):
    where ``qk_norm`` normalises them at the call."""
    map_qk: QKRewrite | None = None
    """How to replace q and k in the bound arguments when they are not simply the `qk` arguments (a
    packed ``qkv`` / ``kv`` entry point); None: the `qk` arguments."""

    def describe(self) -> str:
        """One line for ``stabkit list kernels`` and the README."""
        where = ", ".join((*self.ops, *self.functions))
        cap = "own soft cap" if self.cap is not None else "no soft-cap argument"
        return f"{self.name} ({self.library}): {where}; {cap}"


KERNELS: dict[str, Kernel] = {}
"""name -> Kernel, built-ins first, then user registrations (`register_kernel`)."""
_BY_OP: dict[str, str] = {}
_BY_WRAPPER: dict[Callable[..., Any], str] = {}
_OP_TYPES = (torch._ops.OpOverloadPacket, torch._ops.OpOverload, torch._ops.HigherOrderOperator)
_SIGNATURES: dict[Any, inspect.Signature] = {}


def add(kernel: Kernel) -> Kernel:
    """Add (or replace) `kernel` in the registry; its ops are recognised from now on."""
    old = KERNELS.get(kernel.name)
    if old is not None:
        for op in old.ops:
            _BY_OP.pop(op, None)
    KERNELS[kernel.name] = kernel
    for op in kernel.ops:
        _BY_OP[op] = kernel.name
    return kernel


def op_name(func: Any) -> str | None:
    """``namespace::name`` of a torch op or higher-order op, else None."""
    if isinstance(func, torch._ops.OpOverloadPacket):
        return str(func._qualified_op_name)
    if isinstance(func, torch._ops.OpOverload):
        return str(func._schema.name)
    if isinstance(func, torch._ops.HigherOrderOperator):
        return f"{func.namespace}::{func._name}"
    return None


def is_op(func: Any) -> bool:
    """True for torch ops and higher-order ops (what a custom attention kernel is called through)."""
    return isinstance(func, _OP_TYPES)


def lookup(func: Any) -> Kernel | None:
    """The kernel `func` is (an op by name, or a wrapped Python entry point), else None. Runs per call."""
    name = _BY_WRAPPER.get(func)
    if name is None and isinstance(func, _OP_TYPES):
        name = _BY_OP.get(op_name(func) or "")
    return KERNELS.get(name) if name is not None else None


def note_wrapper(wrapper: Callable[..., Any], kernel: str) -> None:
    """Called by `entry_points` when it wraps a Python entry point of `kernel`."""
    _BY_WRAPPER[wrapper] = kernel


def forget_wrapper(wrapper: Callable[..., Any]) -> None:
    _BY_WRAPPER.pop(wrapper, None)


def signature_of(kernel: Kernel, func: Any) -> inspect.Signature:
    """The signature calls of `func` are bound with: the op's schema, the kernel's `params`, or the
    wrapped Python function's own signature."""
    key = func if not isinstance(func, torch._ops.OpOverloadPacket) else op_name(func)
    cached = _SIGNATURES.get(key)
    if cached is not None:
        return cached
    if isinstance(func, torch._ops.OpOverloadPacket | torch._ops.OpOverload):
        overload = func if isinstance(func, torch._ops.OpOverload) else getattr(func, func.overloads()[0])
        sig = _schema_signature(overload._schema)
    elif kernel.params:
        sig = inspect.Signature(
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in kernel.params]
        )
    else:
        sig = inspect.signature(getattr(func, "__wrapped__", func))
    _SIGNATURES[key] = sig
    return sig


def _schema_signature(schema: Any) -> inspect.Signature:
    params = []
    for arg in schema.arguments:
        kind = inspect.Parameter.KEYWORD_ONLY if arg.kwarg_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        default = arg.default_value if arg.has_default_value() else inspect.Parameter.empty
        params.append(inspect.Parameter(arg.name, kind, default=default))
    return inspect.Signature(params)


def bind(
    kernel: Kernel, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> inspect.BoundArguments:
    """Bind one call's arguments by parameter name (defaults filled in)."""
    sig = signature_of(kernel, func)
    if kernel.params and len(args) > len(sig.parameters):
        args = args[: len(sig.parameters)]  # a newer higher-order op with trailing extras
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def read_call(kernel: Kernel, func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> QKCall:
    """The canonical call of one intercepted kernel call (views of its q and k; no copy, no sync)."""
    call = kernel.read(bind(kernel, func, args, kwargs).arguments)
    call.kernel = kernel.name
    return call


def map_qk(kernel: Kernel, arguments: dict[str, Any], f: QKMap, g: QKMap) -> None:
    """Replace the call's queries q by f(q) and keys k by g(k) in its bound `arguments`, in place
    (``qk_norm`` at a kernel call); ValueError when the kernel names no query or key argument."""
    if kernel.map_qk is not None:
        kernel.map_qk(arguments, f, g)
        return
    q_name, k_name = kernel.qk
    if not (q_name and k_name):
        raise ValueError(f"the kernel {kernel.name!r} names no query and key arguments")
    arguments[q_name] = f(arguments[q_name])
    arguments[k_name] = g(arguments[k_name])


def hides_its_backward(func: Any, grad_at_entry: bool) -> bool:
    """True when a change to this kernel call would not reach its backward: `func` is a torch op called
    with grad mode off although the attention module started its forward with grad mode on — the op
    runs inside an ``autograd.Function``'s forward (flash-attn's ``FlashAttnFunc`` calls
    ``flash_attn::_flash_attn_forward`` so), whose backward uses the arguments and soft cap *it* was
    given. A Python entry point, an op with its own autograd formula called with grad on (aten SDPA,
    FlexAttention's higher-order op) and any call in a forward without grad (evaluation) are fine."""
    return grad_at_entry and not torch.is_grad_enabled() and is_op(func)


def recall(func: Any, bound: inspect.BoundArguments) -> Any:
    """Call `func` with (possibly changed) bound arguments."""
    return func(*bound.args, **bound.kwargs)
