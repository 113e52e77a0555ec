"""What discovery knows about one model: one object, kept on the model, that every caller asks.

`Discovery.of(model)` returns it (made on first use). It holds the map traced while the model is
unchanged (the monitor, the interventions, their verification and the audit ask at attach: one traced
forward serves them all), the inputs discovery last traced (verification runs them again when stabkit
cannot make an input itself) and what discovery has said (the gaps warning, once while the model is
unchanged). It lives in the model's ``__dict__`` — per model, gone with the model, as the record of
active interventions is — not in module globals; a copy or a pickle of the model starts knowing nothing.

When it runs: at attach (or at the model's first forward), `inspect_model` and
`stabkit.interventions.apply`; never per step.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from .examples import Example
from .modelmap import ModelMap

ATTR = "_stabkit_discovery"
"""The model attribute holding its `Discovery`."""


def model_signature(model: nn.Module) -> tuple[Any, ...]:
    """What a traced map depends on: the module tree, the parameter shapes, the training flags and the
    active interventions (what changes what the model computes). Hooks are not counted: the monitor's
    own observe only, and an intervention's come with its entry in the active record."""
    modules = tuple((n, id(m), getattr(m, "training", True)) for n, m in model.named_modules())
    active = tuple((k, id(v)) for k, v in getattr(model, "_stabkit_interventions", {}).items())
    return modules, tuple((n, tuple(p.shape)) for n, p in model.named_parameters()), active


class Discovery:
    """Discovery's memory for one model (see the module docstring)."""

    def __init__(self) -> None:
        self._traced: tuple[tuple[Any, ...], ModelMap] | None = None
        self._said: tuple[Any, ...] | None = None
        self.example: Example | None = None
        """The (args, kwargs) of the model's own forward discovery last traced (None: never)."""

    @classmethod
    def of(cls, model: nn.Module) -> Discovery:
        """The model's Discovery, made on first use."""
        known = model.__dict__.get(ATTR)
        if not isinstance(known, Discovery):
            known = model.__dict__[ATTR] = cls()
        return known

    def traced(self, model: nn.Module) -> ModelMap | None:
        """A copy of the map traced for the model as it is now (None when it changed or was never traced)."""
        if self._traced is None or self._traced[0] != model_signature(model):
            return None
        return copy.deepcopy(self._traced[1])

    def remember(self, model: nn.Module, mmap: ModelMap, example: Example | None) -> None:
        """Keep a traced map (and, for the model's own forward, the inputs it was traced on)."""
        self._traced = (model_signature(model), copy.deepcopy(mmap))
        if example is not None:
            self.example = example

    def first_time_said(self, model: nn.Module) -> bool:
        """True the first time this is asked while the model is unchanged (a gap is said once)."""
        key = model_signature(model)
        if self._said == key:
            return False
        self._said = key
        return True

    def __deepcopy__(self, memo: dict[int, Any]) -> Discovery:
        return Discovery()

    def __reduce__(self) -> tuple[type[Discovery], tuple[()]]:
        return Discovery, ()
