"""`register_router`: teach stabkit a router that discovery cannot see — one that picks its experts in
a fused kernel, or with something other than ``topk`` — by saying what its output holds. Runs once, at
set-up (before `stabkit.attach`); discovery then maps every module of that class that ran in the
traced forward and was not found by behaviour.

Example (docs/guide/moe.md)::

    stabkit.register_router(MyRouter, n_experts="num_experts", top_k="k", logits=0, indices=2)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

from .map import MoEMap, Scoring, Where

if TYPE_CHECKING:
    from ..discovery.trace_builder import TraceBuilder

SCORINGS = ("softmax", "sigmoid", "logits")


@dataclass(frozen=True)
class RouterSpec:
    """What a registered router's output holds (see `register_router`)."""

    n_experts: int | str
    top_k: int | str
    logits: int | None
    indices: int | None
    scoring: Scoring


_ROUTERS: dict[type[nn.Module], RouterSpec] = {}


def register_router(
    cls: type[nn.Module],
    *,
    n_experts: int | str,
    top_k: int | str,
    logits: int | None = 0,
    indices: int | None = None,
    scoring: Scoring = "softmax",
) -> None:
    """Map every module of class `cls` as a MoE router: `n_experts` / `top_k` are numbers or the names
    of the module's attributes holding them; `logits` / `indices` the items of its output tuple holding
    the (T, E) router logits and the (T, k) chosen experts (None for a tensor output that is the
    logits; `indices` None: recomputed as the top-k of `scoring` applied to the logits). The MoE layer
    is the router's parent module."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_router(cls): pass an nn.Module subclass, got {cls!r}")
    if scoring not in SCORINGS:
        raise ValueError(f"register_router: scoring must be one of {SCORINGS}, got {scoring!r}")
    _ROUTERS[cls] = RouterSpec(n_experts, top_k, logits, indices, scoring)


def unregister_router(cls: type[nn.Module]) -> None:
    """Forget `cls` (unknown classes are ignored)."""
    _ROUTERS.pop(cls, None)


def _value(module: nn.Module, spec: int | str) -> int | None:
    value = getattr(module, spec, None) if isinstance(spec, str) else spec
    return int(value) if isinstance(value, int) else None


def registered_routers(b: TraceBuilder, known: set[str]) -> list[MoEMap]:
    """MoE layers for the registered routers that ran in the trace (discovery time)."""
    if not _ROUTERS:
        return []
    out: dict[str, MoEMap] = {}
    for call in b.trace.modules:
        module = b.modules.get(call.path)
        spec = _ROUTERS.get(type(module)) if module is not None else None
        if spec is None or module is None or call.path in known or call.path in out:
            continue
        n, k = _value(module, spec.n_experts), _value(module, spec.top_k)
        if n is None or k is None:
            continue
        logits = Where(call.path, spec.logits)
        indices = Where(call.path, spec.indices) if spec.indices is not None else None
        out[call.path] = MoEMap(
            path=call.path.rpartition(".")[0],
            router=call.path,
            n_experts=n,
            top_k=k,
            scoring=spec.scoring,
            logits=logits,
            indices=indices,
            found="registered",
        )
    return list(out.values())
