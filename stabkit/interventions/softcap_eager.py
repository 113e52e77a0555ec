"""``attn_softcap`` on eager attention: cap the scaled q·kᵀ logits *before* any additive bias, as on
the SDPA path and in Gemma 2 (``cap·tanh(logits/cap)``, then relative-position / ALiBi biases and
masks are added).

Runs at every forward of the capped attention modules, inside their scoped function mode (outer:
after any observer). The logits are followed from the q·kᵀ product (a product of two activations)
through the ops that only scale, cast, reshape or mask them; the first addition of another tensor
(a bias or an additive mask) gets the capped logits; a ``baddbmm(bias, q, kᵀ, beta, alpha)`` (Bloom)
is split into ``cap(alpha·q·kᵀ) + beta·bias``. Where no addition comes, the softmax input is capped.
Entries already masked (at or below ``finfo.min / 2``, or ``-inf``) are never capped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..attention.scope import SOFTMAXES
from .handle import Handle

ADDS: tuple[Callable[..., Any], ...] = (
    torch.add,
    torch.Tensor.add,
    torch.Tensor.__add__,
    torch.Tensor.__radd__,
)
IN_PLACE_ADDS: tuple[Callable[..., Any], ...] = (torch.Tensor.add_, torch.Tensor.__iadd__)
PRODUCTS: tuple[Callable[..., Any], ...] = (
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.bmm,
    torch.Tensor.bmm,
    torch.einsum,
)
BADDBMM: tuple[Callable[..., Any], ...] = (torch.baddbmm, torch.Tensor.baddbmm)


def capped_scores(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Cap the unmasked entries of masked attention logits; masked ones (<= finfo.min/2, -inf) stay."""
    threshold = torch.finfo(x.dtype).min / 2
    return torch.where(x > threshold, cap * torch.tanh(x / cap), x)


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    out = []
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, list | tuple):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


def _is_weight(x: torch.Tensor) -> bool:
    """A parameter, or a view of one (``w.T``)."""
    return isinstance(x, torch.nn.Parameter) or isinstance(x._base, torch.nn.Parameter)


class EagerCap:
    """The handlers of one capped eager attention scope (see the module docstring)."""

    def __init__(self, cap: float, handle: Handle) -> None:
        self.cap = cap
        self.handle = handle
        self.logits: dict[str, dict[int, torch.Tensor]] = {}
        """Per module, the tensors holding uncapped logits in the forward in progress (id -> tensor)."""
        self.capped: dict[str, dict[int, torch.Tensor]] = {}
        """Per module, tensors made from capped logits."""
        self.weighted: set[str] = set()
        """Modules past their softmax in the forward in progress: a product now is weights·v, not logits."""

    def _mark(self, table: dict[str, dict[int, torch.Tensor]], path: str, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            table.setdefault(path, {})[id(out)] = out

    def _is(self, table: dict[str, dict[int, torch.Tensor]], path: str, x: Any) -> bool:
        return isinstance(x, torch.Tensor) and table.get(path, {}).get(id(x)) is x

    def product(
        self, path: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        operands = [x for x in _tensors(args, kwargs) if x.is_floating_point()]
        out = func(*args, **kwargs)
        activations = len(operands) == 2 and all(x.dim() >= 3 and not _is_weight(x) for x in operands)
        if activations and path not in self.weighted and isinstance(out, torch.Tensor) and out.dim() >= 3:
            self._mark(self.logits, path, out)  # q·kᵀ (two activations), not a projection
        return out

    def baddbmm(
        self, path: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        names = ("input", "batch1", "batch2")
        bound = dict(zip(names, args, strict=False)) | kwargs
        bias, q, k = bound.get("input"), bound.get("batch1"), bound.get("batch2")
        if not all(isinstance(t, torch.Tensor) for t in (bias, q, k)):
            return func(*args, **kwargs)
        assert isinstance(bias, torch.Tensor) and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
        logits = torch.bmm(q, k) * bound.get("alpha", 1.0)
        out = capped_scores(logits, self.cap) + bias * bound.get("beta", 1.0)
        self.handle.count(path)
        self._mark(self.capped, path, out)
        return out

    def add(self, path: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        items, kw = list(args), dict(kwargs)
        if len(items) < 2 and "other" in kw:
            items.append(kw.pop("other"))
        if len(items) < 2:
            return self.follow(path, func, args, kwargs)
        a, b = items[0], items[1]
        logits_a, logits_b = self._is(self.logits, path, a), self._is(self.logits, path, b)
        if logits_a == logits_b or not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return self.follow(path, func, args, kwargs)
        if logits_a and func in IN_PLACE_ADDS:
            a.copy_(capped_scores(a, self.cap))  # the model keeps using `a`: cap it in place
        elif logits_a:
            items[0] = capped_scores(a, self.cap)
        else:
            items[1] = capped_scores(b, self.cap)
        out = func(*items, **kw)
        self.handle.count(path)
        self._mark(self.capped, path, out)
        return out

    def softmax(
        self, path: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        x = args[0] if args else kwargs.get("input")
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 4 or dim not in (-1, 3):
            return func(*args, **kwargs)  # not attention weights (e.g. an MoE router inside the scope)
        self.weighted.add(path)
        if self._is(self.capped, path, x):
            return func(*args, **kwargs)
        self.handle.count(path)
        if args:
            return func(capped_scores(x, self.cap), *args[1:], **kwargs)
        return func(**{**kwargs, "input": capped_scores(x, self.cap)})

    def follow(
        self, path: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Any other op: its output holds (capped) logits when an input does."""
        out = func(*args, **kwargs)
        inputs = _tensors(args, kwargs)
        if any(self._is(self.capped, path, x) for x in inputs):
            self._mark(self.capped, path, out)
        elif any(self._is(self.logits, path, x) for x in inputs):
            self._mark(self.logits, path, out)
        return out

    def resolve(self, func: Any) -> Callable[..., Any] | None:
        """The handler of ops not listed by name: follow the logits through them."""
        return self.follow

    def functions(self) -> dict[Callable[..., Any], Callable[..., Any]]:
        table: dict[Callable[..., Any], Callable[..., Any]] = dict.fromkeys(PRODUCTS, self.product)
        table.update(dict.fromkeys(BADDBMM, self.baddbmm))
        table.update(dict.fromkeys((*ADDS, *IN_PLACE_ADDS), self.add))
        table.update(dict.fromkeys(SOFTMAXES, self.softmax))
        return table

    def end(self, path: str) -> None:
        """The module's forward ended: drop the references."""
        self.logits.pop(path, None)
        self.capped.pop(path, None)
        self.weighted.discard(path)
