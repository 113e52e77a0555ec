"""The intervention registry and `apply`: name -> spec, option checking, ordering, one combined handle.

``apply`` runs once, before (or between) training steps. Several interventions given in one call
are applied in the registry's canonical order (`ORDER`: norm surgery first, then attention, then
the output logits), whatever order they are listed in, so the result does not depend on it; the
same intervention twice, or one already active on the model, is refused. If one fails, the ones
already applied are removed again before the error propagates.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Union

from torch import nn

from ..discovery import DiscoveryError, inspect_model
from ..discovery.discover import last_example
from ..discovery.examples import synthesize_example
from .handle import Handle, InterventionError, active_interventions, remember
from .placement import PLACEMENTS, apply_norm_placement
from .qknorm import NORM_KINDS, apply_qk_norm
from .rmsnorm import apply_rmsnorm
from .softcap import apply_attn_softcap, apply_logit_softcap
from .verify import verify
from .zloss import apply_z_loss


@dataclass(frozen=True)
class InterventionSpec:
    """One registry entry."""

    factory: Callable[..., Handle]
    """factory(model, model_map_override=..., **options) -> Handle."""
    defaults: dict[str, Any]
    """Every option with its default value."""
    description: str
    """One line for ``stabkit list interventions``."""
    choices: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    """Options restricted to a set of values."""


REGISTRY: dict[str, InterventionSpec] = {
    "rmsnorm": InterventionSpec(
        apply_rmsnorm,
        {"drop_bias": False},
        "swap every LayerNorm for an RMSNorm carrying the same gain (refuses non-zero biases unless drop_bias)",
    ),
    "norm_placement": InterventionSpec(
        apply_norm_placement,
        {"to": "sandwich"},
        "move the block norms: pre, post, or sandwich (extra norm on each sub-layer output before the add)",
        {"to": PLACEMENTS},
    ),
    "qk_norm": InterventionSpec(
        apply_qk_norm,
        {"kind": "rmsnorm", "eps": None},
        "per-head norm of queries and keys (learnable gain, before RoPE) to bound attention logits",
        {"kind": NORM_KINDS},
    ),
    "attn_softcap": InterventionSpec(
        apply_attn_softcap,
        {"cap": 50.0},
        "cap·tanh(logits/cap) on attention logits before the softmax (Gemma 2)",
    ),
    "logit_softcap": InterventionSpec(
        apply_logit_softcap,
        {"cap": 30.0},
        "cap·tanh(logits/cap) on the output logits (Gemma 2)",
    ),
    "z_loss": InterventionSpec(
        apply_z_loss,
        {"coef": 1e-4},
        "adds the gradient of coef·mean(logsumexp(logits)²) without touching the loss code (PaLM)",
    ),
}
"""Intervention name -> spec. Listed by `describe_registry` (``stabkit list interventions``)."""

ORDER: tuple[str, ...] = tuple(REGISTRY)
"""Canonical application order."""

Spec = Union[str, tuple[str, Mapping[str, Any]]]  # noqa: UP007  (runtime alias on Python 3.10)


def describe_registry() -> str:
    """A table of the interventions, their options with defaults, and what they do."""
    width = max(len(n) for n in REGISTRY)
    lines = []
    for name, spec in REGISTRY.items():
        opts = ", ".join(
            f"{k}={v!r}" + (f" {{{'|'.join(map(str, spec.choices[k]))}}}" if k in spec.choices else "")
            for k, v in spec.defaults.items()
        )
        lines.append(f"{name:<{width}}  {spec.description}")
        lines.append(f"{'':<{width}}    options: {opts}")
    return "\n".join(lines)


def _options(name: str, given: Mapping[str, Any]) -> dict[str, Any]:
    if name not in REGISTRY:
        raise InterventionError(name, "", f"unknown intervention; allowed: {list(REGISTRY)}")
    spec = REGISTRY[name]
    unknown = sorted(set(given) - set(spec.defaults))
    if unknown:
        allowed = ", ".join(f"{k} (default {v!r})" for k, v in spec.defaults.items())
        raise InterventionError(name, "", f"unknown option(s) {unknown}; allowed: {allowed}")
    options = {**spec.defaults, **given}
    for key, allowed_values in spec.choices.items():
        if options[key] not in allowed_values:
            raise InterventionError(name, "", f"{key} must be one of {allowed_values}, got {options[key]!r}")
    return options


def _normalise(specs: Iterable[Spec] | Mapping[str, Mapping[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    if isinstance(specs, Mapping):
        items: Iterable[Any] = [(k, v or {}) for k, v in specs.items()]
    elif isinstance(specs, str):
        items = [specs]
    else:
        items = specs
    out: list[tuple[str, dict[str, Any]]] = []
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
        out.append((name, _options(name, given)))
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
    that each is in effect (`stabkit.interventions.verify`)."""
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
    items.sort(key=lambda item: ORDER.index(item[0]))
    if example is not None and model_map is None:
        try:
            inspect_model(model, example=example)  # trace on it: the interventions read this map
        except DiscoveryError as exc:
            raise InterventionError(names[0], type(model).__name__, str(exc)) from exc
    done: list[Handle] = []
    try:
        for name, options in items:
            handle = REGISTRY[name].factory(model, model_map_override=model_map, **options)
            remember(model, name, handle)
            done.append(handle)
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
