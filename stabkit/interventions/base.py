"""What an intervention plug-in is: a class that performs one reversible surgery and returns a `Handle`.

An intervention joins the fourth plug-in family (`stabkit.plugins.INTERVENTIONS`, beside probes,
detectors and actions) with a decorator, in one file::

    from dataclasses import dataclass, field
    from stabkit.interventions import Intervention, Handle
    from stabkit.plugins import INTERVENTIONS
    from stabkit.tables import bounds

    @dataclass(frozen=True)
    class MyOptions:
        factor: float = field(default=0.5, metadata=bounds(lo=0.0, lo_open=True))
        \"\"\"What it does (one line).\"\"\"

    @INTERVENTIONS.register
    class MyFix(Intervention):
        name = "my_fix"            # what `apply(model, "my_fix")` and configs call it
        order = 55                 # canonical application order (see `order`)
        description = "one line for `stabkit list interventions`"
        options_class = MyOptions

        def apply(self, model, model_map, options: MyOptions) -> Handle: ...

The class declares its name, its place in the canonical order, its options (a dataclass whose field
defaults are the defaults; `choices` and `stabkit.tables.bounds` in a field's metadata restrict a
value) and `apply`. Optional methods: `verify` (the apply-time check that it is in effect), and for
a fix that the 'rescue' action may switch on mid-run, ``midrun = True``, `midrun_options` (its
options at the switch) and `match_at_switch` (setting its new parameters so the model's output
barely moves). `stabkit.interventions.apply` checks the options (`check_options`), runs the
plug-ins in canonical order and verifies them; the rescue and the audit read the registry live, so
a plug-in registered at any time before it is named is seen.

When it runs: `check_options` and `apply` once per `stabkit.interventions.apply` call (before or
between training steps); `verify` right after, on one traced forward; `midrun_options` and
`match_at_switch` once per rescue. The class is instantiated with no arguments for each of these.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from torch import nn

from ..tables import RANGE, Range, TableError, as_table, fill
from .handle import Handle, InterventionError

if TYPE_CHECKING:
    from ..discovery.trace import Trace

CHOICES = "stabkit.interventions.choices"
"""Field-metadata key of the values an option may take (`choices`)."""


def choices(*values: Any) -> dict[str, tuple[Any, ...]]:
    """Field metadata restricting an option to `values`: ``field(default="pre", metadata=choices("pre", "post"))``."""
    return {CHOICES: tuple(values)}


@dataclass(frozen=True)
class NoOptions:
    """The options of an intervention that takes none."""


class Intervention:
    """Base class of intervention plug-ins (see the module docstring)."""

    name: ClassVar[str] = ""
    """Registry name: what `apply(model, name)`, ``attach(interventions=...)``, recipes and advice use."""
    order: ClassVar[int] = 100
    """Canonical application order, lower first, whatever order a call lists them in: norm surgery
    (rmsnorm 10, norm_placement 20), then attention (qk_clip 25, qk_norm 30, attn_softcap 40), then the output
    logits (logit_softcap 50, z_loss 60); ties keep registration order."""
    description: ClassVar[str] = ""
    """One line for ``stabkit list interventions``."""
    options_class: ClassVar[type[Any]] = NoOptions
    """A dataclass of its options: each field's default is the option's default; `choices(...)` or
    `stabkit.tables.bounds(...)` in its metadata restrict it; its ``__post_init__`` may refuse more."""
    midrun: ClassVar[bool] = False
    """True when it can go on mid-run (the 'rescue' action) without changing much what the model
    computes at the switch."""
    midrun_preference: ClassVar[int] = 100
    """Among the mid-run fixes an event's advice names, the rescue prefers the lowest (qk_norm 10,
    attn_softcap 20, z_loss 30, logit_softcap 40; qk_clip 5, first): `RescueOptions.fixes` defaults to
    this order."""

    def apply(self, model: nn.Module, model_map: Any, options: Any) -> Handle:
        """Perform the surgery on `model` with `options` (an `options_class` instance) and return its
        Handle (whose ``remove()`` restores the model exactly). `model_map` is the user's override of
        discovery (a ModelMap or a dict; None: discover) — pass it on to
        `stabkit.interventions.common.model_map` / `logits_map`. Raise `InterventionError` naming
        this intervention, the module and what is missing when it cannot apply."""
        raise NotImplementedError(f"intervention {self.name!r} does not implement apply()")

    def verify(self, trace: Trace, model: nn.Module, handle: Handle) -> None:
        """Check on `trace` (one traced forward right after `apply`, `stabkit.discovery.trace.Trace`)
        that it is in effect; raise `InterventionError` when not. The common checks (the forward runs,
        every module holding a parameter it added runs) are made for every intervention already."""

    def midrun_options(self, metrics: Mapping[str, float], margin: float) -> dict[str, Any]:
        """Options to switch it on with mid-run (merged over the defaults), from the newest logged
        host value of every metric; `margin` is how far above the logged values a bound starts
        (`RescueOptions.cap_margin`). Default: none."""
        return {}

    def match_at_switch(self, model: nn.Module, handle: Handle, rerun: Callable[[], Any]) -> None:
        """Right after a mid-run `apply`: set its new parameters so the output barely moves.
        `rerun()` re-runs the step's kept forwards (no grad, the step's RNG; the RNG is restored),
        so forward hooks registered around it measure what the switched-on model sees."""

    def attach_optimizer(
        self,
        handle: Handle,
        optimizer: Any,
        record: Callable[[str, Any], None] | None = None,
        hooks: Any = None,
    ) -> None:
        """For a fix that acts after each optimizer step (``qk_clip``): register what it needs on
        `optimizer` (a torch optimizer or `stabkit.optimizers.OptimizerSet`) through `hooks` (a
        `stabkit.hooks.Registrar`; None: directly), undone by ``handle.remove()``; `record(name,
        value)` takes its per-step metrics where a monitor wants them. Called by
        `stabkit.interventions.attach_optimizer` (``attach(interventions=...)``, the rescue, the
        recipes). Default: nothing."""


def option_defaults(cls: type[Intervention]) -> dict[str, Any]:
    """Every option of `cls` with its default."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls.options_class):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def option_choices(cls: type[Intervention]) -> dict[str, tuple[Any, ...]]:
    """Options of `cls` restricted to a set of values."""
    return {
        f.name: f.metadata[CHOICES] for f in dataclasses.fields(cls.options_class) if CHOICES in f.metadata
    }


def option_ranges(cls: type[Intervention]) -> dict[str, Range]:
    """Options of `cls` restricted to a range (`stabkit.tables.bounds`)."""
    return {f.name: f.metadata[RANGE] for f in dataclasses.fields(cls.options_class) if RANGE in f.metadata}


def check_options(cls: type[Intervention], given: Mapping[str, Any]) -> Any:
    """`given` (option -> value) over the defaults, as an instance of ``cls.options_class``.

    Raises InterventionError naming the intervention for an unknown option (listing the allowed ones
    with their defaults), a value outside its choices or range, or one the dataclass refuses. `given`
    may be an instance of ``cls.options_class`` itself (checked the same way)."""
    given = as_table(given)
    defaults = option_defaults(cls)
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        allowed = ", ".join(f"{k} (default {v!r})" for k, v in defaults.items()) or "none"
        raise InterventionError(cls.name, "", f"unknown option(s) {unknown}; allowed: {allowed}")
    options = {**defaults, **given}
    for key, allowed_values in option_choices(cls).items():
        if options[key] not in allowed_values:
            raise InterventionError(
                cls.name, "", f"{key} must be one of {allowed_values}, got {options[key]!r}"
            )
    try:  # types and ranges: the one table check every plug-in family's options go through
        return fill(cls.options_class, given, cls.name)
    except TableError as exc:
        key = exc.key[len(cls.name) + 1 :] if exc.key.startswith(cls.name + ".") else ""
        raise InterventionError(cls.name, "", f"{key} {exc.problem}" if key else exc.problem) from None


def describe_options(cls: type[Intervention]) -> str:
    """``key=default {a|b}`` / ``key=default (a number in ...)`` for each option of `cls`."""
    ranges, allowed = option_ranges(cls), option_choices(cls)
    parts = []
    for key, value in option_defaults(cls).items():
        text = f"{key}={value!r}"
        if key in allowed:
            text += f" {{{'|'.join(map(str, allowed[key]))}}}"
        if key in ranges:
            integer = isinstance(value, int) and not isinstance(value, bool)
            hint = f"; {ranges[key].hint}" if ranges[key].hint else ""
            text += f" ({ranges[key].describe(integer)}{hint})"
        parts.append(text)
    return ", ".join(parts)
