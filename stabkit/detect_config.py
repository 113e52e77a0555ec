"""`DetectConfig`: which detectors run, what happens on an event, and each plug-in's options.

Read once when a Monitor attaches; never changed afterwards. It holds only what belongs to no one
plug-in (`actions`, `detectors`, `sync`); every setting of a detector or an action is in `options`,
by plug-in name, checked against that plug-in's options dataclass (its ``options_class``, in the
plug-in's own file: e.g. `stabkit.detectors.spike.SpikeOptions`) whose defaults come from published
practice. The one range check is the ``bounds`` metadata of those dataclasses' fields, read by
`stabkit.tables.fill`; an error names the plug-in and the field (``DetectConfig.options.spike.window:
must be an integer >= 1, got 0``).

A leaf: it imports only `stabkit.plugins` (the names of the detectors and actions),
`stabkit.events` (the severities) and `stabkit.tables` (the check). Building a config loads no plug-in code, except the options class of
a plug-in named in `options` (checked when the config is built).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

from .events import SEVERITIES, severity_rank
from .plugins import ACTIONS, DETECTORS
from .tables import as_table, fill, merged

OptionsT = TypeVar("OptionsT")


@dataclass(init=False)
class DetectConfig:
    """Settings of the detectors and actions of one Monitor.

    Timing: with every action at ``warn`` (the default) nothing is decided between log intervals:
    the detectors read the host copy the Monitor makes once per ``log_every`` steps, so events
    arrive up to ``log_every`` steps late and a non-finite step is reported by metric, not by
    module (it cannot be replayed any more). Any other action for a kind (or ``sync=True``) makes
    that kind decide every step, on the host, from one small copy in the optimizer pre-step hook
    (before the update: non-finite values, gradient-norm spikes) and one at ``Monitor.step``
    (after it: loss and update-ratio spikes, drift, the optimizer-state check).

    Cost, measured against the bare Monitor on a d128 4-layer GPT (one CPU thread, batch 8×64):
    defaults about +1 % step time; per-step decisions about +2.5 % (including the every-step
    optimizer-state check); ``options={"nonfinite": {"per_module": True}}`` about 3×. A replay costs
    about one extra step, on a hit only.
    """

    actions: dict[str, Any] = field(default_factory=dict)
    """Per event kind (a detector's name in `stabkit.plugins.DETECTORS`; ``stabkit list plugins``): an
    action or a list of them (a name in `stabkit.plugins.ACTIONS`: warn, raise, skip, rollback, dump,
    rescue, or a registered one). Kinds not named warn."""
    detectors: tuple[str, ...] | None = None
    """Which detectors run (names in `stabkit.plugins.DETECTORS`); None = every registered one."""
    options: dict[str, dict[str, Any]] = field(default_factory=dict, metadata=merged())
    """Settings of the detectors and actions, by plug-in name, each checked against that plug-in's
    options dataclass: ``{"spike": {"window": 64}, "nonfinite": {"per_module": True}, "rollback":
    {"snapshot_every": 25}, "attn_entropy": {"drop": 0.5}, "rescue": {"lr_factor": 0.5}}``. A recipe's
    variant lays its ``options`` over the recipe's key by key."""
    sync: bool = False
    """Decide non-finite steps every step even when the action is 'warn' (one scalar copy per step), so
    they are localized (the module that made the first NaN/Inf is named) and the step can be replayed.
    Off by default on every device: on an accelerator the per-step copy stalls the device, and on a
    CPU it is ~0.3 ms of host work a step (0.5 % of a 512-token loop, `stabkit bench --size
    small-step`); the warn-only event says how to turn it on. (Earlier 0.x versions decided per step by
    default on a CPU, so that a run reported differently on a laptop and on a GPU.)"""
    act_on: str = "warning"
    """The mildest severity the actions other than 'warn' act on (`stabkit.events.SEVERITIES`: 'info',
    'warning', 'critical'): a note ('info') is reported, never skipped, rolled back or raised on."""
    _checked: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __init__(
        self,
        actions: Mapping[str, Any] | None = None,
        detectors: Sequence[str] | None = None,
        options: Mapping[str, Mapping[str, Any]] | None = None,
        sync: bool = False,
        act_on: str = "warning",
    ) -> None:
        self.actions = dict(actions) if isinstance(actions, Mapping) else actions  # type: ignore[assignment]
        self.detectors = detectors  # type: ignore[assignment]
        self.options = options if options is not None else {}  # type: ignore[assignment]
        self.sync = sync
        self.act_on = act_on
        self._checked = {}
        self.__post_init__()

    def __post_init__(self) -> None:
        if self.act_on not in SEVERITIES:
            raise ValueError(f"DetectConfig.act_on must be one of {list(SEVERITIES)}, got {self.act_on!r}")
        if not isinstance(self.sync, bool):
            raise ValueError(f"DetectConfig.sync must be True or False, got {self.sync!r}")
        if self.actions is None:
            self.actions = {}
        if not isinstance(self.actions, dict):
            raise ValueError(
                f"DetectConfig.actions must be a dict kind -> action(s), got {type(self.actions).__name__}"
            )
        kinds = DETECTORS.names()
        unknown = sorted(set(self.actions) - set(kinds))
        if unknown:
            raise ValueError(f"DetectConfig.actions has unknown kind(s) {unknown}; allowed: {list(kinds)}")
        self.actions = {kind: _normalise_actions(kind, self.actions.get(kind, "warn")) for kind in kinds}
        if self.detectors is not None:
            if isinstance(self.detectors, str) or not all(isinstance(d, str) for d in self.detectors):
                raise ValueError("DetectConfig.detectors must be None or a list of detector names")
            self.detectors = tuple(self.detectors)
            missing = sorted(set(self.detectors) - set(kinds))
            if missing:
                raise ValueError(
                    f"DetectConfig.detectors names unknown detector(s) {missing}; known: {list(kinds)}"
                )
        if isinstance(self.options, Mapping):  # an options dataclass may be given instead of its dict
            self.options = {k: as_table(v) for k, v in self.options.items()}
        if not isinstance(self.options, Mapping) or not all(
            isinstance(k, str) and isinstance(v, Mapping) for k, v in self.options.items()
        ):
            raise ValueError(
                'DetectConfig.options must map plug-in names to dicts, e.g. {"spike": {"window": 64}}'
            )
        self.options = {k: dict(v) for k, v in self.options.items()}
        known = [*kinds, *(a for a in ACTIONS.names() if a not in kinds)]
        unknown = sorted(set(self.options) - set(known))
        if unknown:
            raise ValueError(
                f"DetectConfig.options names unknown detector(s) or action(s) {unknown}; known: {known}"
            )
        self._checked = {}
        for name in self.options:  # checked now (a recipe's error is reported when it is loaded)
            cls = _options_class(name)
            if cls is not None:
                self.options_for(name, cls)
        self._check_skip_can_act()

    def _check_skip_can_act(self) -> None:
        """Raise when 'skip' is asked for spikes but could never act: it acts before the update, so only
        on gradient-norm and update spikes, which are notes unless `SpikeOptions.warn` names them."""
        if "skip" not in self.actions.get("spike", ()) or self.act_on == "info":
            return
        warn = tuple(self.options.get("spike", {}).get("warn", ("loss",)))
        if all(pattern == "loss" for pattern in warn):
            raise ValueError(
                "DetectConfig: actions['spike'] = 'skip' acts before the update, on gradient-norm and update "
                f"spikes, which are notes ('info'); with act_on={self.act_on!r} it would never skip. Set "
                "act_on='info' (OLMo's skip-step) or name those series in options['spike']['warn']"
            )

    @overload
    def options_for(self, name: str) -> Any: ...

    @overload
    def options_for(self, name: str, options_class: type[OptionsT]) -> OptionsT: ...

    def options_for(self, name: str, options_class: type[Any] | None = None) -> Any:
        """The options of plug-in `name`: ``options[name]`` over the defaults of its options dataclass
        (`options_class`, else the plug-in's declared ``options_class``, loaded from the registry),
        checked by `stabkit.tables.fill` (types, ``bounds``, the dataclass's own checks); a ValueError
        names the plug-in and the key (``DetectConfig.options.<name>.<key>: ...``). Cached."""
        cls = options_class if options_class is not None else _options_class(name)
        if cls is None:
            raise ValueError(f"stabkit: the plug-in {name!r} declares no options_class")
        made = self._checked.get(name)
        if made is None or type(made) is not cls:
            made = fill(cls, self.options.get(name, {}), f"DetectConfig.options.{name}")
            self._checked[name] = made
        return made

    def runs(self, kind: str) -> bool:
        """True when the detector of `kind` is switched on (`detectors`)."""
        return self.detectors is None or kind in self.detectors

    def acts_on(self, severity: str) -> bool:
        """True when the actions other than 'warn' act on an event of `severity` (`act_on`)."""
        return severity_rank(severity) >= severity_rank(self.act_on)

    def needs_sync(self, kind: str) -> bool:
        """True when `kind` must be decided every step on the host (an action other than warn)."""
        acts = self.actions.get(kind, ("warn",))
        return any(a != "warn" for a in acts) or (kind == "nonfinite" and bool(self.sync))


def _options_class(name: str) -> type[Any] | None:
    """The options dataclass plug-in `name` declares (a detector first, then an action), or None."""
    for registry in (DETECTORS, ACTIONS):
        if name in registry:
            cls = getattr(registry.load(name), "options_class", None)
            if cls is not None:
                return cls
    return None


def _normalise_actions(kind: str, value: Any) -> tuple[str, ...]:
    acts = (value,) if isinstance(value, str) else tuple(value) if isinstance(value, Sequence) else None
    if not acts or not all(isinstance(a, str) and a in ACTIONS for a in acts):
        raise ValueError(
            f"DetectConfig.actions[{kind!r}] must be one of {list(ACTIONS.names())} or a list of them, got {value!r}"
        )
    return tuple(dict.fromkeys(acts))
