"""`apply`: name -> plug-in (`stabkit.plugins.INTERVENTIONS`), option checking, ordering, one handle.

``apply`` runs once, before (or between) training steps. Several interventions given in one call
are applied in canonical order (each plug-in's `Intervention.order`: norm surgery first, then
attention, then the output logits; `ORDER`), whatever order they are listed in, so the result does
not depend on it; the same intervention twice, or one already active on the model, is refused. If
one fails, the ones already applied are removed again before the error propagates.

Everything here reads the registry when it is used, so an intervention registered after import
(``@INTERVENTIONS.register``) is applied, ordered, listed and checked like a built-in. `REGISTRY` is
a live name -> `InterventionSpec` view of it (what recipes and older code read); assigning a spec
to it registers a plug-in made from that spec.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Union

from torch import nn

from ..discovery import DiscoveryError, inspect_model
from ..discovery.discover import last_example
from ..discovery.examples import synthesize_example
from ..distributed.context import is_dtensor
from ..plugins import INTERVENTIONS, LiveNames
from .base import Intervention, check_options, choices, describe_options, option_choices, option_defaults
from .handle import Handle, InterventionError, active_interventions, remember
from .verify import verify


@dataclass(frozen=True)
class InterventionSpec:
    """One intervention as a plain record (read from its plug-in class by `REGISTRY`)."""

    factory: Callable[..., Handle]
    """factory(model, model_map_override=..., **options) -> Handle."""
    defaults: dict[str, Any]
    """Every option with its default value."""
    description: str
    """One line for ``stabkit list interventions``."""
    choices: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    """Options restricted to a set of values."""


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


def spec_of(cls: type[Intervention]) -> InterventionSpec:
    """The plain record of plug-in `cls`."""

    def factory(model: nn.Module, model_map_override: Any = None, **options: Any) -> Handle:
        return cls().apply(model, model_map_override, check_options(cls, options))

    return InterventionSpec(factory, option_defaults(cls), cls.description, option_choices(cls))


def _constant(value: Any) -> Callable[[], Any]:
    return lambda: value


def _from_spec(name: str, spec: InterventionSpec) -> type[Intervention]:
    """A plug-in class built from a spec (``REGISTRY[name] = InterventionSpec(...)``, the older way)."""
    fields = [
        (
            k,
            Any,
            field(
                default_factory=_constant(v),
                metadata=choices(*spec.choices.get(k, ())) if k in spec.choices else {},
            ),
        )
        for k, v in spec.defaults.items()
    ]
    options = dataclasses.make_dataclass(f"{name}_options", fields, frozen=True)

    def apply(self: Intervention, model: nn.Module, model_map: Any, opts: Any) -> Handle:
        given = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}
        return spec.factory(model, model_map_override=model_map, **given)

    attrs = {"name": name, "description": spec.description, "options_class": options, "apply": apply}
    return type(f"SpecIntervention_{name}", (Intervention,), attrs)


class _Registry(MutableMapping[str, InterventionSpec]):
    """Name -> `InterventionSpec`, read live from `stabkit.plugins.INTERVENTIONS` in canonical order."""

    def __getitem__(self, name: str) -> InterventionSpec:
        if name not in INTERVENTIONS:
            raise KeyError(name)
        return spec_of(INTERVENTIONS.load(name))

    def __setitem__(self, name: str, spec: InterventionSpec) -> None:
        INTERVENTIONS.unregister(name)
        INTERVENTIONS.register(_from_spec(name, spec))

    def __delitem__(self, name: str) -> None:
        if name not in INTERVENTIONS:
            raise KeyError(name)
        INTERVENTIONS.unregister(name)

    def __iter__(self) -> Iterator[str]:
        return iter(ordered())

    def __len__(self) -> int:
        return len(INTERVENTIONS.names())

    def __contains__(self, name: object) -> bool:
        return name in INTERVENTIONS


REGISTRY: MutableMapping[str, InterventionSpec] = _Registry()
"""Intervention name -> spec, a live view of `stabkit.plugins.INTERVENTIONS`. Listed by
`describe_registry` (``stabkit list interventions``)."""

Spec = Union[str, tuple[str, Mapping[str, Any]]]  # noqa: UP007  (runtime alias on Python 3.10)


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
        items: Iterable[Any] = [(k, v or {}) for k, v in specs.items()]
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
            and isinstance(item[1], Mapping)
        ):
            name, given = item[0], dict(item[1])
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
            ex = example if example is not None else last_example(model) or synthesize_example(model)
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
