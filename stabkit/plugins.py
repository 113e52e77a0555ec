"""The plug-in registries: one plain name -> class table per family (probes, detectors, actions,
interventions).

A plug-in is one file holding one class; it joins its family with a decorator::

    from stabkit.plugins import DETECTORS

    @DETECTORS.register
    class MyDetector(RowDetector):
        kind = "my_kind"
        ...

Built-in plug-ins are listed below by *import path* (``"module:Class"``), so that the names are
known without importing their code (a `DetectConfig` validates ``actions={"spike": ...}`` without
torch) and importing a family loads nothing until a plug-in is used. This module imports nothing
from stabkit (a leaf): configs, the monitor and the plug-ins themselves all import it.

When it runs: names are read when a config is built; classes are loaded when the monitor attaches
(`Registry.load`), once per process. A plug-in outside stabkit registers when its module is imported:
import it before a config, `attach` or `apply` names it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar, overload

T = TypeVar("T")


class Registry(Generic[T]):
    """Name -> plug-in class of one family. Registration order is the order the monitor uses."""

    def __init__(
        self,
        family: str,
        builtins: dict[str, str],
        name_attr: str,
        on_register: Callable[[Any], None] | None = None,
    ) -> None:
        self.family = family
        """What the entries are ('probe', 'detector', 'action', 'intervention'), for error messages."""
        self._name_attr = name_attr
        self._entries: dict[str, T | str] = dict(builtins)
        self._on_register = on_register

    def register(self, cls: T) -> T:
        """Decorator: add `cls` under its name attribute (``kind`` / ``name``); replaces a built-in of
        the same name (so a project can swap one), refuses a second class under a user name."""
        name = getattr(cls, self._name_attr, None)
        if not isinstance(name, str) or not name:
            raise TypeError(
                f"stabkit: a {self.family} plug-in needs a non-empty class attribute {self._name_attr!r}, "
                f"{getattr(cls, '__name__', cls)!r} has {name!r}"
            )
        current = self._entries.get(name)
        same = getattr(current, "__qualname__", None) == getattr(cls, "__qualname__", None)
        if current is not None and not isinstance(current, str) and not same:
            raise ValueError(
                f"stabkit: a {self.family} named {name!r} is already registered ({current!r}); "
                f"pick another {self._name_attr} or call unregister({name!r}) first"
            )
        self._entries[name] = cls
        if self._on_register is not None:
            self._on_register(cls)
        return cls

    def unregister(self, name: str) -> None:
        """Remove `name` (e.g. a test's plug-in); unknown names are ignored."""
        self._entries.pop(name, None)

    def describe(self, name: str) -> str:
        """Where `name` comes from (``module:Class``), without importing it."""
        entry = self._entries[name]
        return (
            entry if isinstance(entry, str) else f"{entry.__module__}:{getattr(entry, '__qualname__', entry)}"
        )

    def names(self) -> tuple[str, ...]:
        """Every registered name, in registration order (built-ins first). Imports nothing."""
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def load(self, name: str) -> T:
        """The class registered under `name` (imports a built-in's module on first use)."""
        if name not in self._entries:
            raise KeyError(
                f"stabkit: no {self.family} named {name!r}; registered: {', '.join(self._entries)}"
            )
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            loaded: T = getattr(importlib.import_module(module), attr)
            self._entries[name] = loaded
            return loaded
        return entry

    def classes(self, where: Callable[[T], bool] | None = None) -> Iterator[T]:
        """Every class (loading built-ins), in order; only those `where` accepts when given."""
        for name in list(self._entries):
            cls = self.load(name)
            if where is None or where(cls):
                yield cls


PROBE_FAMILIES: set[str] = set()
"""Statistic families that registered probe plug-ins add to the built-in ones (`MonitorConfig.families`)."""


def _add_families(cls: Any) -> None:
    PROBE_FAMILIES.update(getattr(cls, "families", ()))


PROBES: Registry[Any] = Registry(
    "probe",
    {
        "act": "stabkit.probes.activations:ActivationProbe",
        "logits": "stabkit.probes.logits:LogitProbe",
        "grad": "stabkit.probes.grads:GradProbe",
        "attn": "stabkit.probes.attention:AttentionProbe",
        "outliers": "stabkit.probes.outliers:OutlierProbe",
        "moe": "stabkit.moe.probe:MoEProbe",
    },
    "name",
    _add_families,
)
"""Probes (`stabkit.probes.base.Probe`): each turns hooks into statistics of the families it serves."""

DETECTORS: Registry[Any] = Registry(
    "detector",
    {
        "nonfinite": "stabkit.nonfinite.kind:NonfiniteDetector",
        "spike": "stabkit.detectors.spike:SpikeDetector",
        "drift": "stabkit.detectors.drift:DriftDetector",
        "amp": "stabkit.nonfinite.amp:AmpDetector",
        "attn_entropy": "stabkit.detectors.entropy:EntropyCollapseDetector",
        "update_norm": "stabkit.detectors.update_norm:UpdateNormDetector",
        "outliers": "stabkit.detectors.outliers:OutlierDetector",
        "depth_grad": "stabkit.detectors.depth_grad:DepthGradDetector",
        "expert_collapse": "stabkit.detectors.moe_collapse:ExpertCollapseDetector",
        "dead_experts": "stabkit.detectors.moe_dead:DeadExpertsDetector",
        "router_z": "stabkit.detectors.router_z:RouterZDetector",
    },
    "kind",
)
"""Detectors (`stabkit.detectors.base.Detector`): each judges host values and returns events of its kind."""

ACTIONS: Registry[Any] = Registry(
    "action",
    {
        "warn": "stabkit.actions.warn:Warn",
        "raise": "stabkit.actions.raising:Raise",
        "skip": "stabkit.actions.skip:Skip",
        "rollback": "stabkit.actions.rollback:Rollback",
        "dump": "stabkit.actions.dump:Dump",
        "rescue": "stabkit.actions.rescue:Rescue",
        "clip": "stabkit.actions.clip:Clip",
    },
    "name",
)
"""Actions (`stabkit.actions.base.Action`): what happens on an event, per `DetectConfig.actions`."""


INTERVENTIONS: Registry[Any] = Registry(
    "intervention",
    {
        "rmsnorm": "stabkit.interventions.rmsnorm:RMSNormIntervention",
        "norm_placement": "stabkit.interventions.placement:NormPlacementIntervention",
        "qk_clip": "stabkit.interventions.qkclip:QKClipIntervention",
        "qk_norm": "stabkit.interventions.qknorm:QKNormIntervention",
        "attn_softcap": "stabkit.interventions.softcap:AttnSoftcapIntervention",
        "logit_softcap": "stabkit.interventions.softcap:LogitSoftcapIntervention",
        "z_loss": "stabkit.interventions.zloss:ZLossIntervention",
        "router_fp32": "stabkit.interventions.router_fp32:RouterFP32Intervention",
        "router_z_loss": "stabkit.interventions.router_loss:RouterZLossIntervention",
        "load_balance_loss": "stabkit.interventions.router_loss:LoadBalanceIntervention",
        "aux_free_balance": "stabkit.interventions.aux_free:AuxFreeBalanceIntervention",
    },
    "name",
)
"""Interventions (`stabkit.interventions.Intervention`): reversible surgery switched on by
`stabkit.interventions.apply`, ``attach(interventions=...)``, recipes and the 'rescue' action; applied
in their canonical `order` (`stabkit.interventions.ORDER`), not in this table's order."""


class LiveNames(Sequence[str]):
    """A read-only sequence of names recomputed by `compute` on every use: a module-level constant
    that still sees plug-ins registered after import (``name in LIVE``, ``list(LIVE)``, ``LIVE[0]``)."""

    def __init__(self, compute: Callable[[], Sequence[str]]) -> None:
        self._compute = compute

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...

    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        return tuple(self._compute())[index]

    def __len__(self) -> int:
        return len(self._compute())

    def __iter__(self) -> Iterator[str]:
        return iter(tuple(self._compute()))

    def __contains__(self, name: object) -> bool:
        return name in tuple(self._compute())

    def __eq__(self, other: object) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, LiveNames) else other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(tuple(self))
