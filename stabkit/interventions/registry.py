"""`apply`: name -> plug-in (`stabkit.plugins.INTERVENTIONS`), option checking, ordering, one handle.

``apply`` runs once, before (or between) training steps. Several interventions given in one call
are applied in canonical order (each plug-in's `Intervention.order`: norm surgery first, then
attention, then the output logits; `ORDER`), whatever order they are listed in, so the result does
not depend on it; the same intervention twice, or one already active on the model, is refused. If
one fails, the ones already applied are removed again before the error propagates.

Everything here reads the registry when it is used, so an intervention registered after import
(``@INTERVENTIONS.register``) is applied, ordered, listed and checked like a built-in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Union

from torch import nn

from ..discovery import DiscoveryError, inspect_model
from ..discovery.examples import synthesize_example
from ..discovery.known import Discovery
from ..distributed.context import is_dtensor
from ..plugins import INTERVENTIONS, LiveNames
from ..tables import as_table
from .base import Intervention, check_options, describe_options
from .handle import Handle, InterventionError, active_interventions, remember
from .verify import verify


def plugin(name: str) -> type[Intervention]:
    """The plug-in class registered as `name` (loads a built-in); InterventionError when none is."""
    if name not in INTERVENTIONS:
        raise InterventionError(name, "", f"unknown intervention; allowed: {list(ordered())}")
    cls: type[Intervention] = INTERVENTIONS.load(name)
    return cls


def ordered() -> tuple[str, ...]:
    """Every registered intervention name in canonical order (`Intervention.order`, then registration)."""
    names = INTERVENTIONS.names()
    rank = {n: i for i, n in enumerate(names)}
    return tuple(sorted(names, key=lambda n: (INTERVENTIONS.load(n).order, rank[n])))


ORDER = LiveNames(ordered)
"""Canonical application order (live: a plug-in registered later has its place in it)."""


Spec = Union[str, tuple[str, Any]]  # noqa: UP007  (runtime alias on Python 3.10)
"""An intervention as a name, or a (name, options) pair: a dict or the options dataclass itself."""


def describe_registry() -> str:
    """A table of the interventions, their options with defaults, and what they do."""
    names = ordered()
    width = max(len(n) for n in names)
    lines = []
    for name in names:
        cls = plugin(name)
        lines.append(f"{name:<{width}}  {cls.description}")
        lines.append(f"{'':<{width}}    options: {describe_options(cls)}")
    return "\n".join(lines)


def _normalise(specs: Iterable[Spec] | Mapping[str, Mapping[str, Any]]) -> list[tuple[str, Any]]:
    """(name, checked options) per entry."""
    if isinstance(specs, Mapping):
        items: Iterable[Any] = [(k, as_table(v) or {}) for k, v in specs.items()]
    elif isinstance(specs, str):
        items = [specs]
    else:
        items = specs
    out: list[tuple[str, Any]] = []
    for item in items:
        if isinstance(item, str):
            name, given = item, {}
        elif (
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[0], str)
            and (isinstance(item[1], Mapping) or dataclasses.is_dataclass(item[1]))
        ):
            name, given = item[0], as_table(item[1])
        else:
            raise InterventionError(
                str(item), "", "each intervention is a name or a (name, {option: value}) pair"
            )
        out.append((name, check_options(plugin(name), given)))
    return out


def apply_many(
    model: nn.Module,
    specs: Iterable[Spec] | Mapping[str, Mapping[str, Any]],
    model_map: Any = None,
    example: Any = None,
) -> Handle:
    """Apply several interventions (names, ``(name, options)`` pairs, or a ``{name: options}`` dict)
    in canonical order and return one handle (the intervention's own handle when there is one).
    With an example input (given, made by discovery, or the one it last traced), one forward checks
    that each is in effect (`stabkit.interventions.verify`); not on a model with DTensor parameters
    (FSDP2, tensor parallel), where no forward is traced (it would run collectives, and the trace
    follows plain tensors only): there only each intervention's own runtime checks remain (attn_softcap
    warns of a module that ran without a call it could cap)."""
    items = _normalise(specs)
    names = [n for n, _ in items]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise InterventionError(repeated[0], "", "listed more than once")
    active = active_interventions(model)
    for name in names:
        if name in active:
            raise InterventionError(
                name, type(model).__name__, "already active on this model (remove it first)"
            )
    order = ordered()
    items.sort(key=lambda item: order.index(item[0]))
    if example is not None and model_map is None:
        try:
            inspect_model(model, example=example)  # trace on it: the interventions read this map
        except DiscoveryError as exc:
            raise InterventionError(names[0], type(model).__name__, str(exc)) from exc
    done: list[Handle] = []
    try:
        for name, options in items:
            handle = plugin(name)().apply(model, model_map, options)
            remember(model, name, handle)
            done.append(handle)
        if not _sharded(model):
            ex = example if example is not None else Discovery.of(model).example or synthesize_example(model)
            if ex is not None:
                verify(model, dict(zip([n for n, _ in items], done, strict=True)), ex)
    except BaseException:
        for handle in reversed(done):
            handle.remove()
        raise
    if len(done) == 1:
        return done[0]
    return Handle(model, [n for n, _ in items], done)


def attach_optimizer(
    handle: Handle, optimizer: Any, record: Callable[[str, Any], None] | None = None, hooks: Any = None
) -> None:
    """Let every intervention under `handle` that acts after optimizer steps (``qk_clip``) watch
    `optimizer` (`Intervention.attach_optimizer`); the others ignore it. Call once the optimizer
    exists: ``handle = apply(model, "qk_clip"); attach_optimizer(handle, optimizer)``."""
    if optimizer is None:
        return
    for part in handle.children or [handle]:
        for name in part.names:
            if name in INTERVENTIONS and not part.removed:
                plugin(name)().attach_optimizer(part, optimizer, record, hooks)


def join_optimizer(
    handle: Handle, optimizer: Any, record: Callable[[str, Any], None] | None = None
) -> dict[str, Any] | None:
    """Wire switched-on interventions into an optimizer that already exists — the one place that does
    it (`attach(..., interventions=)`, the rescue action): those that act after optimizer steps
    (``qk_clip``) watch it (`attach_optimizer`), and the parameters they added (norm gains) join it as
    one new param group without weight decay. Returns that group (None when none was added), so the
    caller can take it out again (`Monitor` does at detach). An optimizer built after `apply` already
    holds the new parameters: call `attach_optimizer` alone then (the recipes' worker does)."""
    if optimizer is None:
        return None
    attach_optimizer(handle, optimizer, record)
    new = handle.new_parameters()
    if not new:
        return None
    optimizer.add_param_group({"params": new, "weight_decay": 0.0})
    group: dict[str, Any] = optimizer.param_groups[-1]
    return group


def apply(
    model: nn.Module,
    name: str | Iterable[Spec] | Mapping[str, Mapping[str, Any]],
    *,
    model_map: Any = None,
    example: Any = None,
    **options: Any,
) -> Handle:
    """Switch on intervention `name` with `options` (``apply(model, "attn_softcap", cap=30)``), or
    several at once (``apply(model, ["qk_norm", ("attn_softcap", {"cap": 30})])``).

    Returns a Handle: ``remove()`` restores the model exactly; ``new_parameters()`` lists added gains
    (``optimizer.add_param_group({"params": handle.new_parameters()})``); ``metrics()`` gives values
    to log. Discovery traces one forward to find where to act — on `example` (a batch: a tensor, a
    tuple, a dict of keyword inputs, or an (args, kwargs) pair) when stabkit cannot make an input for
    the model — and one more forward checks the result is in effect. Raises InterventionError (a
    ValueError) naming the intervention, the module and what is missing when it cannot apply or is
    not in effect, when only module names are known where a traced forward is needed (pass
    `example`), and for unknown names or options. `model_map` overrides discovery.
    """
    if isinstance(name, str):
        return apply_many(model, [(name, options)], model_map, example)
    if options:
        raise InterventionError(
            "apply", "", "with several interventions, pass options per entry: [(name, {option: value})]"
        )
    return apply_many(model, name, model_map, example)


def _sharded(model: nn.Module) -> bool:
    """Some parameter of `model` is a DTensor (FSDP2, tensor parallel)."""
    return any(is_dtensor(p) for p in model.parameters())
