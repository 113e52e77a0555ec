"""Trace a sharded model (tensor parallel, FSDP2, both) as the model it shards.

A model whose parameters are DTensors computes, on each rank, its piece of the whole: local heads,
local MLP columns, and between them the layout changes torch.distributed's module hooks make (TP's
``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` / ``PrepareModuleInput``, FSDP2's
unshard and reshard). Discovery's trace follows tensors from op to op, which those conversions hide.
So while discovery traces it, `unsharded` puts every DTensor parameter's full tensor in its place
(one all-gather per parameter) and switches torch.distributed's forward hooks off: the forward is the
one-process forward, the ModelMap the one-process map (global head counts, every role), and nothing
in the traced pass is a collective. On exit the parameters (the same objects: the optimizer keeps
working) and hooks are put back.

Runs once, at discovery time (attach, `inspect`, `interventions.apply`), on every rank at the same
point — the all-gathers are collectives, as the forward's would be. The full parameters are held for
the traced forward only; a model whose full parameters exceed `FULL_LIMIT` bytes is mapped by names
instead (with a note: pass ``model_map=`` if names do not find everything).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

FULL_LIMIT = 4 << 30
"""Largest total size (bytes) of a sharded model's full parameters that discovery gathers to trace it."""


class TooLargeToGather(RuntimeError):
    """The full parameters of a sharded model exceed `FULL_LIMIT`."""


def is_sharded(model: nn.Module) -> bool:
    """True when some parameter is a DTensor (tensor parallel, FSDP2)."""
    return any(_is_dtensor(p) for p in model.parameters())


def _is_dtensor(t: Any) -> bool:
    return type(t).__name__ == "DTensor" or type(getattr(t, "data", None)).__name__ == "DTensor"


def _distributed_hook(hook: Any) -> bool:
    """A forward hook torch.distributed registered (TP layouts, FSDP2's unshard/reshard)."""
    owner = getattr(hook, "__func__", hook)
    return str(getattr(owner, "__module__", "") or "").startswith("torch.distributed")


def full_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters at their full (global) shapes."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


@contextmanager
def unsharded(model: nn.Module, limit: int = FULL_LIMIT) -> Iterator[None]:
    """While the block runs: DTensor parameters replaced by their full tensors, torch.distributed's
    forward hooks off (see the module docstring). A model without DTensor parameters: nothing changes.
    Raises `TooLargeToGather` (before any collective) when the full parameters exceed `limit`."""
    if not is_sharded(model):
        yield
        return
    size = full_bytes(model)
    if size > limit:
        raise TooLargeToGather(
            f"its full parameters ({size / 2**30:.1f} GiB) exceed what discovery gathers to trace a sharded "
            f"model ({limit / 2**30:.0f} GiB)"
        )
    swapped: list[tuple[nn.Module, str, nn.Parameter]] = []
    hooks: list[tuple[dict[int, Any], dict[int, Any]]] = []
    """(a module's hook table, its entries before): restored whole, in their order."""
    try:
        with torch.no_grad():
            for module in model.modules():
                for name, p in list(module._parameters.items()):
                    if p is not None and _is_dtensor(p):
                        full = p.full_tensor()  # type: ignore[attr-defined]  # a collective: every rank, same order
                        module._parameters[name] = nn.Parameter(full, requires_grad=p.requires_grad)
                        swapped.append((module, name, p))
        for module in model.modules():
            for table in (module._forward_pre_hooks, module._forward_hooks):
                if any(_distributed_hook(h) for h in table.values()):
                    hooks.append((table, dict(table)))
                    for key, hook in list(table.items()):
                        if _distributed_hook(hook):
                            del table[key]
        yield
    finally:
        for table, before in hooks:
            table.clear()
            table.update(before)
        for module, name, p in swapped:
            module._parameters[name] = p
