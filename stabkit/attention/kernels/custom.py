"""`register_kernel`: teach stabkit any other attention kernel — a ``torch.library.custom_op``, an
op registered from C++/Triton, or a plain Python function — by naming its q and k arguments, their
layout and its masking arguments. Runs once, at set-up (before `stabkit.attach`).

Example (docs/guide/kernels.md)::

    @torch.library.custom_op("mylib::attention", mutates_args=())
    def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tensor: ...

    stabkit.register_kernel("mylib::attention", layout="bhsd", causal="causal", scale="scale")
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..call import Positions, QKCall
from . import entry_points
from .base import KERNELS, Kernel, add, op_name
from .flash import window as window_of

LAYOUTS = ("bhsd", "bshd", "sbhd", "thd")
"""(batch, heads, seq, dim); (batch, seq, heads, dim) as flash-attn; (seq, batch, heads, dim) as
Megatron/TE; packed (tokens, heads, dim) with cumulative sequence lengths."""
ALIGNS = ("top_left", "bottom_right")


def _arg(a: Mapping[str, Any], spec: str | int) -> Any:
    if isinstance(spec, int):
        return list(a.values())[spec]
    return a[spec]


def _setting(a: Mapping[str, Any], spec: Any) -> Any:
    """A fixed value, or the value of the argument `spec` names (a str)."""
    return a.get(spec) if isinstance(spec, str) else spec


def to_bhsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A view of `x` in (B, H, S, D) (packed "thd": (1, H, T, D))."""
    if layout == "bhsd":
        return x
    if layout == "bshd":
        return x.transpose(1, 2)
    if layout == "sbhd":
        return x.permute(1, 2, 0, 3)
    return x.transpose(0, 1).unsqueeze(0)


def generic_reader(
    *,
    q: str | int,
    k: str | int,
    layout: str,
    causal: str | bool,
    align: str,
    scale: str | float | None,
    window: str | tuple[int, int] | None,
    softcap: str | None,
    sinks: str | None,
    cu_seqlens: tuple[str, str] | None,
) -> Callable[[Mapping[str, Any]], QKCall]:
    """A reader for a kernel described by argument names (see `register_kernel`)."""

    def read(a: Mapping[str, Any]) -> QKCall:
        qt, kt = to_bhsd(_arg(a, q), layout), to_bhsd(_arg(a, k), layout)
        if qt.dim() != 4 or kt.dim() != 4:
            raise ValueError(f"q {tuple(qt.shape)} / k {tuple(kt.shape)} do not match layout {layout!r}")
        win = _setting(a, window)
        masks: dict[str, Any] = {
            "causal": bool(_setting(a, causal)),
            "window": window_of(*win) if win is not None else None,
        }
        positions = None
        bottom = align == "bottom_right"
        if cu_seqlens is not None:
            cu_q, cu_k = a[cu_seqlens[0]], a[cu_seqlens[1]]
            positions = Positions.packed(cu_q, cu_k, qt.shape[2], kt.shape[2], bottom_right=bottom, **masks)
        elif masks["causal"] or masks["window"]:
            positions = Positions.aligned(qt.shape[2], kt.shape[2], qt.device, bottom_right=bottom, **masks)
        cap = _setting(a, softcap) if softcap is not None else None
        sink = a.get(sinks) if sinks is not None else None
        s = _setting(a, scale)
        return QKCall(
            qt,
            kt,
            float(s) if s is not None else None,
            positions=positions,
            softcap=float(cap) if cap else None,
            sinks=sink,
        )

    return read


def _target_names(target: Any) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """(ops, functions, default name) of what the user registers."""
    if isinstance(target, str) and "::" in target:
        return (target,), (), target.replace("::", ".")
    name = op_name(target)
    if name is not None:
        return (name,), (), name.replace("::", ".")
    if isinstance(target, str) and ":" in target:
        return (), (target,), target.rpartition(":")[2]
    if callable(target):
        original = getattr(target, "__stabkit_original__", target)
        module, qualname = getattr(original, "__module__", None), getattr(original, "__qualname__", "")
        if not module or "<locals>" in qualname:
            raise ValueError(
                f"cannot register {target!r}: stabkit finds Python kernels by import path, and this one has "
                "none (a local function). Define it at module level, or make it a torch.library.custom_op"
            )
        return (), (f"{module}:{qualname}",), qualname
    raise TypeError(
        "register_kernel(target): pass an op ('namespace::name' or torch.ops.namespace.name), a Python "
        f"function, or 'module:qualname'; got {type(target).__name__}"
    )


def register_kernel(
    target: Any,
    *,
    q: str | int = "q",
    k: str | int = "k",
    layout: str = "bhsd",
    causal: str | bool = False,
    causal_align: str = "top_left",
    scale: str | float | None = None,
    window: str | tuple[int, int] | None = None,
    softcap: str | None = None,
    sinks: str | None = None,
    cu_seqlens: tuple[str, str] | None = None,
    name: str | None = None,
) -> Kernel:
    """Make stabkit measure (and discover) attention computed by `target`.

    `target`: an op (``"mylib::attention"`` or ``torch.ops.mylib.attention``), a Python function, or
    ``"module:qualname"``. `q` / `k`: the arguments holding queries and keys (name or position);
    `layout`: one of ``LAYOUTS`` ("thd" needs `cu_seqlens` = the names of the cumulative lengths of
    q and k); `causal`: an argument name or a fixed bool, aligned `causal_align` ("top_left" as SDPA,
    "bottom_right" as flash-attn); `scale`: an argument name or a number (None: 1/sqrt(head_dim));
    `window`: an argument name holding (left, right) or a fixed pair (-1 = unbounded); `softcap`:
    the argument of the kernel's own soft cap (lets ``attn_softcap`` cap through it); `sinks`: the
    argument holding learned sink logits (H,). Returns the registered `Kernel` (re-registering a
    name replaces it).
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if causal_align not in ALIGNS:
        raise ValueError(f"causal_align must be one of {ALIGNS}, got {causal_align!r}")
    if layout == "thd" and cu_seqlens is None:
        raise ValueError(
            "layout 'thd' (packed) needs cu_seqlens=(name of q's, name of k's cumulative lengths)"
        )
    ops, functions, default = _target_names(target)
    names = [
        n for n in (q, k, scale, causal, window, softcap, sinks, *(cu_seqlens or ())) if isinstance(n, str)
    ]
    _check_names(target, ops, functions, names)
    cap = None
    if softcap is not None:

        def cap(a: dict[str, Any], value: float, _arg: str = softcap) -> None:
            if a.get(_arg):
                raise ValueError(f"the call soft-caps already ({_arg}={a[_arg]})")
            a[_arg] = float(value)

    reader = generic_reader(
        q=q,
        k=k,
        layout=layout,
        causal=causal,
        align=causal_align,
        scale=scale,
        window=window,
        softcap=softcap,
        sinks=sinks,
        cu_seqlens=cu_seqlens,
    )
    qk = (q if isinstance(q, str) else "", k if isinstance(k, str) else "")
    kernel = add(Kernel(name or default, "registered", reader, ops=ops, functions=functions, cap=cap, qk=qk))
    if entry_points.active():
        entry_points.install().remove()  # wrap it now for the monitors already attached
    return kernel


def _check_names(target: Any, ops: tuple[str, ...], functions: tuple[str, ...], names: list[str]) -> None:
    """Refuse argument names the target does not have (when its signature can be read now)."""
    params: list[str] | None = None
    if ops:
        namespace, _, op = ops[0].partition("::")
        packet = getattr(getattr(torch.ops, namespace, None), op, None) if namespace else None
        overloads = packet.overloads() if packet is not None else []
        if overloads:
            params = [arg.name for arg in getattr(packet, overloads[0])._schema.arguments]
    elif functions:
        try:
            fn = target if callable(target) else entry_points.import_target(functions[0])
            params = list(inspect.signature(getattr(fn, "__stabkit_original__", fn)).parameters)
        except (ImportError, AttributeError, ValueError, TypeError):
            params = None
    if params is None:
        return
    missing = [n for n in names if n not in params]
    if missing:
        raise ValueError(f"register_kernel: {target!r} has no argument(s) {missing}; its arguments: {params}")


def forget_kernel(name: str) -> None:
    """Remove a registered kernel (tests, notebooks); unknown names are ignored."""
    kernel = KERNELS.pop(name, None)
    if kernel is not None:
        from .base import _BY_OP

        for op in kernel.ops:
            _BY_OP.pop(op, None)
