"""Where ``qk_norm`` normalises q and k when they are not plain slices of a projection module's
output. Installed at apply time; the handlers run at every forward of the attention modules.

- **At the projection op** (`hook_weight_ops`): q = ``einsum(x, self.W_Q)`` inside a forward, with no
  Linear: a scoped function mode on the module making the op normalises, per head, the op's output
  features that make q (and k) — before RoPE, like the module-output route.
- **At the attention call** (`hook_at_call`): q and k built from several projections (MLA: a "nope"
  part per head and a rotary part shared by the heads), or otherwise out of reach: the call's q and
  k arguments — SDPA, a known kernel (`stabkit.attention.kernels`: their last dim is the head dim
  whatever the layout), or the operands of eager attention's q·kᵀ product (the first product of two
  activations in the module's forward) — are normalised per head over the head dim, after RoPE
  (a rotation keeps a vector's norm, so the logit bound is the same).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..attention import kernels
from ..attention.scope import SDPA, attach_scope
from ..discovery.trace import LINEAR
from .common import keep_hook
from .handle import Handle, InterventionError
from .kernel_change import KernelChange

_MATMULS: tuple[Callable[..., Any], ...] = (
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.bmm,
    torch.Tensor.bmm,
)
_BADDBMM: tuple[Callable[..., Any], ...] = (torch.baddbmm, torch.Tensor.baddbmm)


def normalise_columns(
    y: torch.Tensor, norm: nn.Module, cols: list[int], index: torch.Tensor | None
) -> torch.Tensor:
    """`y` with its output features `cols` (head-major) normalised per head by `norm`."""
    if index is None or cols == list(range(y.shape[-1])):
        return norm(y)  # (..., H·hd): the whole output, in head order
    return y.index_copy(y.dim() - 1, index, norm(y.index_select(y.dim() - 1, index)))


def _tensors(values: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, list | tuple):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def hook_weight_ops(
    handle: Handle, model: nn.Module, a: Any, norm_q: nn.Module, norm_k: nn.Module, name: str
) -> None:
    """Normalise the q and k features of the projection ops that use `a.q_weight` / `a.k_weight`."""
    targets: dict[int, tuple[nn.Module, list[int]]] = {}
    for weight, norm, columns in ((a.q_weight, norm_q, a.q_columns), (a.k_weight, norm_k, a.k_columns)):
        try:
            param = model.get_parameter(weight)
        except AttributeError as exc:
            raise InterventionError(name, a.path, f"projection weight {weight!r} not found") from exc
        targets[id(param)] = (norm, [c for head in columns for c in head])
    cache: dict[tuple[int, torch.device], torch.Tensor] = {}

    def handler(path: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        for operand in _tensors((*args, *kwargs.values())):
            key = id(operand) if id(operand) in targets else id(operand._base)
            if key in targets:
                norm, cols = targets[key]
                index = cache.get((key, out.device))
                if index is None:
                    index = cache[(key, out.device)] = torch.tensor(cols, device=out.device)
                return normalise_columns(out, norm, cols, index)
        return out

    sites = sorted({a.q_site or "", a.k_site or ""})
    keep_hook(handle, attach_scope(model, sites, dict.fromkeys(LINEAR, handler), outer=True, owner=name))


class _AtCall:
    """The handlers of `hook_at_call` for one attention module."""

    def __init__(self, norm_q: nn.Module, norm_k: nn.Module, head_dim: int, change: KernelChange) -> None:
        self.norm_q, self.norm_k, self.head_dim = norm_q, norm_k, head_dim
        self.change = change
        """Applies the norm at known kernels' calls where their backward sees it."""
        self.done: dict[str, int] = {}
        """Products normalised in the forward in progress (eager: only the first, q·kᵀ)."""
        self.calls: dict[str, int] = {}

    def sdpa(self, path: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        items, kw = list(args), dict(kwargs)
        for i, (name, norm) in enumerate((("query", self.norm_q), ("key", self.norm_k))):
            if len(items) > i:
                items[i] = norm(items[i])
            else:
                kw[name] = norm(kw[name])
        self.calls[path] = self.calls.get(path, 0) + 1
        return func(*items, **kw)

    def kernel(self, func: Any) -> Callable[..., Any] | None:
        kernel = kernels.lookup(func)
        if kernel is None or not (kernel.map_qk is not None or all(kernel.qk)):
            return None

        def handler(path: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            def normalise(arguments: dict[str, Any]) -> None:
                kernels.map_qk(kernel, arguments, self.norm_q, self.norm_k)
                self.calls[path] = self.calls.get(path, 0) + 1

            return self.change.call(path, kernel, fn, args, kwargs, normalise)

        return handler

    def product(
        self, path: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Eager q·kᵀ: normalise the operands of the first activation product of the forward."""
        if self.done.get(path):
            return func(*args, **kwargs)
        hd = self.head_dim
        args = tuple(args)
        if func is torch.einsum and len(args) == 3 and _keys_last(str(args[0])):
            if args[1].shape[-1] == hd and args[2].shape[-1] == hd:
                self.done[path] = 1
                return func(args[0], self.norm_q(args[1]), self.norm_k(args[2]), **kwargs)
        elif func in _MATMULS or func in _BADDBMM:
            first = 1 if func in _BADDBMM else 0
            a, b = args[first], args[first + 1]
            if (
                isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and a.dim() >= 3
                and a.shape[-1] == hd
                and b.shape[-2] == hd
                and not isinstance(a, nn.Parameter)
                and not isinstance(b, nn.Parameter)
            ):
                self.done[path] = 1
                b = self.norm_k(b.transpose(-1, -2)).transpose(-1, -2)
                new = (*args[:first], self.norm_q(a), b, *args[first + 2 :])
                return func(*new, **kwargs)
        return func(*args, **kwargs)

    def end(self, path: str, handled: int, output: Any) -> None:
        if self.done.pop(path, 0):
            self.calls[path] = self.calls.get(path, 0) + 1


def _keys_last(equation: str) -> bool:
    lhs, _, out = equation.replace(" ", "").partition("->")
    terms = lhs.split(",")
    return len(terms) == 2 and terms[0][-1:] == terms[1][-1:] and terms[0][-1:] not in out


def hook_at_call(
    handle: Handle, model: nn.Module, a: Any, norm_q: nn.Module, norm_k: nn.Module, name: str
) -> _AtCall:
    """Normalise q and k at the attention calls the module at `a.path` makes (see the module docstring)."""
    if not a.head_dim:
        raise InterventionError(name, a.path, "head_dim unknown (pass model_map= with it)")
    change = KernelChange(name, handle)
    at = _AtCall(norm_q, norm_k, int(a.head_dim), change)
    functions: dict[Callable[..., Any], Any] = {SDPA: at.sdpa}
    if a.impl == "eager" or a.impl.startswith("hf:eager"):
        functions.update(dict.fromkeys((*_MATMULS, *_BADDBMM, torch.einsum), at.product))
    scope = attach_scope(
        model,
        [a.path],
        functions,
        outer=True,
        on_exit=at.end,
        owner=name,
        resolve=at.kernel,
        on_enter=change.enter,
    )
    keep_hook(handle, scope)
    keep_hook(handle, kernels.install((model,)))
    return at
