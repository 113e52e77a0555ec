"""What a detector plug-in is: a class that reads host values of named series and returns events.

A detector never sees the Monitor, the model or a tensor. It gets a `DetectorContext` (the
model's layout as plain names, fixed at attach, the `DetectConfig`, and its options: the dataclass
it names in ``options_class``, filled from ``DetectConfig.options[kind]``) and, for each step it is
shown, a mapping series name -> float. It returns an `Observation`: its events (kind = its own
``kind``) and optional extra series to log beside the step's values (e.g. a score). So a
detector is tested from plain rows, without a model (see `stabkit.detectors.judge.Judge`).

When it runs (decided by the orchestration, `stabkit.decisions`): at the log interval, on the rows
of the one host copy, when every action configured for its kind is 'warn'; every step, on a small
host copy of the series it wants, when an action needs a decision in time (skip, rollback, raise…)
— series matching `before_update` in the optimizer's step pre-hook (so 'skip' can still skip the
update), the others at `Monitor.step`.

To add one: one file with a subclass, decorated with ``@stabkit.plugins.DETECTORS.register``, its
options dataclass beside it (fields with defaults, ranges as `stabkit.tables.bounds` metadata), its
advice rows in `advice` and `signature` naming the row of an event (see the guide page "Extend
stabkit" and `stabkit/detectors/entropy.py`). A kind that must see tensors to decide declares a
device part through `device_checks` (the extension point, `stabkit.detectors.device`).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, overload

from ..detect_config import DetectConfig, OptionsT
from ..events import Event
from .advice import Advice

if TYPE_CHECKING:
    from ..discovery import ModelMap
    from .device import DeviceChecks, DeviceContext


@dataclass(frozen=True)
class BlockInfo:
    """One Transformer block as a detector knows it."""

    path: str
    index: int
    placement: str
    """'pre', 'post', 'sandwich', 'output', 'parallel' or 'unknown' (`stabkit.discovery.Placement`)."""


@dataclass(frozen=True)
class MoELayerInfo:
    """One mixture-of-experts layer as a detector knows it (from `ModelMap.moe`)."""

    path: str
    """The MoE layer's module path (its series are ``moe/<path>/...``)."""
    n_experts: int
    """E: the experts its router chooses among."""
    top_k: int
    """k: experts chosen per token (the busiest expert's share is at most 1/k)."""


@dataclass(frozen=True)
class DetectorContext:
    """The model as names, and the settings: everything a detector may know. Built once at attach
    (`from_model_map`), or by hand in a test."""

    config: DetectConfig = field(default_factory=DetectConfig)
    attention_paths: tuple[str, ...] = ()
    blocks: tuple[BlockInfo, ...] = ()
    norm_paths: tuple[str, ...] = ()
    output_head: str | None = None
    vocab_size: int | None = None
    warmup_steps: int | None = None
    """The run's LR warmup in steps, when `attach` was told it (None: not known)."""
    moe_layers: tuple[MoELayerInfo, ...] = ()
    """The mixture-of-experts layers whose routing the MoE probe measures (empty: a dense model)."""

    @classmethod
    def from_model_map(
        cls, model_map: ModelMap, config: DetectConfig, warmup_steps: int | None = None
    ) -> DetectorContext:
        """The context of a discovered model (`warmup_steps`: the run's warmup, if known)."""
        return cls(
            config=config,
            warmup_steps=warmup_steps,
            attention_paths=tuple(model_map.attention_paths),
            blocks=tuple(BlockInfo(b.path, b.index, str(b.placement)) for b in model_map.blocks),
            norm_paths=tuple(n.path for b in model_map.blocks for n in b.norms),
            output_head=model_map.output_head,
            vocab_size=model_map.vocab_size,
            moe_layers=tuple(
                MoELayerInfo(m.path, m.n_experts, m.top_k) for m in model_map.moe if m.logits is not None
            ),
        )

    @property
    def block_paths(self) -> list[str]:
        """Paths of the blocks, in order."""
        return [b.path for b in self.blocks]

    @property
    def log_vocab(self) -> float | None:
        """log V: log Z of all-zero output logits (None when the vocabulary size is unknown)."""
        return math.log(self.vocab_size) if self.vocab_size else None

    def moe_layer(self, path: str) -> MoELayerInfo | None:
        """The MoE layer at `path`, else None."""
        return next((m for m in self.moe_layers if m.path == path), None)

    def block_of(self, path: str) -> BlockInfo | None:
        """The block that holds module `path` (or is it), else None."""
        for b in self.blocks:
            if path == b.path or path.startswith(b.path + "."):
                return b
        return None

    @overload
    def options(self, kind: str) -> Any: ...

    @overload
    def options(self, kind: str, options_class: type[OptionsT]) -> OptionsT: ...

    def options(self, kind: str, options_class: type[Any] | None = None) -> Any:
        """``DetectConfig.options[kind]`` over the defaults of `options_class` (else of the plug-in's
        declared ``options_class``), checked (see `DetectConfig.options_for`)."""
        return (
            self.config.options_for(kind, options_class) if options_class else self.config.options_for(kind)
        )


@dataclass
class Observation:
    """What a detector returns for one step: events, and extra series for the step's row."""

    events: list[Event] = field(default_factory=list)
    series: dict[str, float] = field(default_factory=dict)


class Detector:
    """Base class of detector plug-ins (pure Python over floats; checkpointable through `state_dict`)."""

    kind: ClassVar[str] = ""
    """Registry name = the kind of its events = the key of `DetectConfig.actions`."""
    watches: ClassVar[tuple[str, ...]] = ()
    """Globs of the series it reads (override `wants` for a rule that depends on the context)."""
    before_update: ClassVar[tuple[str, ...]] = ()
    """Globs of series known before the optimizer step (gradient norms): when decided per step they
    are judged in the step pre-hook, so 'skip' can still skip the update."""
    quiet_after: ClassVar[tuple[str, ...]] = ()
    """Kinds whose event at the same step makes this detector's event redundant (it is dropped)."""
    advice: ClassVar[dict[str, Advice]] = {}
    """Its rows of the advice table (`stabkit list advice`), by signature."""
    options_class: ClassVar[type[Any] | None] = None
    """The dataclass of its settings (``DetectConfig.options[kind]``; each field's default is the
    setting's default, `stabkit.tables.bounds` in its metadata its range); read it with
    ``ctx.options(self.kind, TheOptions)``. None: it takes none."""

    # An event may say where the trouble began in ``details["since"]`` (a step): the 'rescue' action
    # rolls back to a snapshot from at or before it.

    def __init__(self, ctx: DetectorContext) -> None:
        self.ctx = ctx
        self._wants: dict[str, bool] = {}
        self._before: dict[str, bool] = {}

    def wants(self, name: str) -> bool:
        """True when series `name` is one this detector reads (cached per name)."""
        hit = self._wants.get(name)
        if hit is None:
            hit = any(fnmatch.fnmatchcase(name, p) for p in self.watches)
            self._wants[name] = hit
        return hit

    def judged_before_update(self, name: str) -> bool:
        """True when `name` is judged in the optimizer step pre-hook when deciding per step."""
        hit = self._before.get(name)
        if hit is None:
            hit = self._before[name] = any(fnmatch.fnmatchcase(name, p) for p in self.before_update)
        return hit

    def observe(self, step: int, values: Mapping[str, float]) -> Observation:
        """Judge the values of `step` (only series it `wants`, in the order recorded)."""
        raise NotImplementedError

    def signature(self, event: Event) -> str:
        """The key of `advice` that fits `event` (the first row by default)."""
        return next(iter(self.advice))

    def rewind(self, step: int) -> None:
        """Model and optimizer were restored to their state before step `step` (the actions
        'rollback' and 'rescue'): forget the values of later steps, which describe a trajectory that
        no longer exists (a drift window still full of the growth rolled back would report it again
        at once). Default: nothing (a detector of single values, or one whose state is per event)."""

    def device_checks(self, ctx: DeviceContext) -> DeviceChecks | None:
        """The extension point for a kind that must see tensors (`stabkit.detectors.device`): its
        device part, built once at attach from the narrow device-side `ctx`; None (the default) for a
        detector of host values only."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready state for a checkpoint ({} = stateless)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""
