"""What every probe shares: the context it is attached with, which forwards count as training, and
warn-once-then-disable on failure.

A probe registers hooks at `attach` (once) and removes them at `detach`. Its hooks run during the
user's forward/backward/optimizer step and only add device tensors to the Recorder.

Under ``torch.compile`` the hooks are traced into the model's graph (see `StepPhase` for how the
sampling decision keeps the set of graphs fixed, and `stabkit.stats.recorder` for how statistics leave
the graph). A hook must read only values that are the same on every step of its kind — never
`ProbeContext.step` — and warnings a hook raises are deferred to `Probe.end_step` (`Probe.fail`).

Only *training forwards* enter the statistics (`ProbeContext.training_forward`, see `forwards`): a
forward that starts in training mode with gradients enabled. Validation forwards (``model.eval()``,
``torch.no_grad()``), ``generate()`` and any other forward under ``no_grad`` between steps are left
out (not logged at all), and so is the recomputation that activation checkpointing runs during
backward (its forward hooks fire a second time).
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..config import ModuleSelection, MonitorConfig
from ..discovery import ModelMap
from ..discovery.trace import first_tensor_in, tracing
from ..hooks import HookSet, Registrar, hook_warning
from ..stats import Recorder
from ..stats.step_facts import StepFacts
from .forwards import TrainingForwards
from .phase import StepPhase

T = TypeVar("T")

TRACE_EVERY_STEP = True
"""Under ``torch.compile``, statistics measured on every step (``every`` 1: full monitoring) are traced
into the model's graph as tensor ops, which Inductor fuses into the kernels that write the tensors
they read; measured on sampled steps, they come from opaque ops a gated phase asks at run time
(`stabkit.stats.opaque`). False: opaque ops always (a switch for comparing the two)."""
F = TypeVar("F", bound=Callable[..., Any])


class ProbeError(RuntimeError):
    """A probe met something it does not understand (raised only with MonitorConfig(strict=True))."""


@dataclass
class ProbeContext:
    """What a probe may use: the model, its map, the optimizer, the recorder and the step clock."""

    model: nn.Module
    model_map: ModelMap
    optimizer: torch.optim.Optimizer | None
    recorder: Recorder
    config: MonitorConfig
    step: Callable[[], int]
    """The index of the step in progress (completed `Monitor.step` calls so far)."""
    facts: StepFacts = field(default_factory=StepFacts)
    """What the step knows (the Monitor's `StepFacts`: GradScaler, distributed context, a skipped
    update, the after-update finiteness note), shared with the detectors' device parts."""
    hooks: Registrar = field(default_factory=HookSet)
    """Where probes register their hooks (the Monitor's `HookSet`: order kept, removed at detach)."""
    forwards: TrainingForwards = field(init=False)
    """Which forward in progress is a training forward (hooks on the model and on the ancestors of
    its blocks and attention modules, installed while a probe uses them)."""

    phase: StepPhase = field(init=False)
    """The sampling decision of the step in progress (`StepPhase`; `refresh` keeps it current)."""

    def __post_init__(self) -> None:
        mm = self.model_map
        cfg = self.config
        self.phase = StepPhase(
            cfg.every,
            cfg.attention_every,
            next((p.device for p in self.model.parameters()), torch.device("cpu")),
            deep_every=cfg.deep_cadence,
        )
        self.forwards = TrainingForwards(
            self.model, [*mm.block_paths, *mm.attention_paths], self.hooks, cadence=self.phase.any_every
        )
        self.refresh()
        self.recorder.gate = self.phase.on

    def refresh(self) -> None:
        """The Monitor's step count changed (eager, outside any hook): update `phase`."""
        self.phase.set(self.step())

    def sampled(self, every: int | None = None) -> bool:
        """True when the step in progress is one on which per-layer statistics are taken (never
        during discovery's traced forward). Reads `phase`, never the step: safe in compiled hooks.
        Traced with a gated phase (`StepPhase.gated`): True — the opaque ops decide at run time."""
        phase = self.phase
        if not torch.compiler.is_compiling():  # eager: two flags (the hooks' common case, every step)
            on = phase.sampled if every is None or every == phase.every else phase.on(every)
            return on and not tracing()
        if tracing():
            return False
        if phase.gated:
            return True
        return phase.on(every or phase.every)

    def deep(self) -> bool:
        """True when the step in progress also takes the whole-model statistics
        (`MonitorConfig.deep_every`: parameter and update norms, outliers, optimizer-state checks)."""
        return self.sampled(self.phase.deep_every)

    def compiled_values(
        self,
        every_step: Callable[[], torch.Tensor] | None,
        opaque: Callable[[int, int], torch.Tensor],
        every: int | None = None,
    ) -> tuple[torch.Tensor, int | None]:
        """Under torch.compile, in a probe's traced hook: a packed statistics vector and the cadence
        the Recorder gates it by (`Recorder.add_packed`). Measured on every step (``every`` 1, and
        `TRACE_EVERY_STEP`): `every_step()`, graph ops Inductor fuses into the kernels that write the
        tensor they read (None: not traceable, e.g. a DTensor). Else ``opaque(gate, every)``: the
        probe's opaque op, which a gated phase asks at run time, so one graph serves every step.
        `every`: the statistic's cadence when it is not `MonitorConfig.every` (the whole-model
        statistics' `deep_every`): traced into the sampled graph of a guarded phase, whose Recorder
        keeps it only on the steps of that cadence (no graph of its own)."""
        phase, base = self.phase, self.config.every
        cadence = base if every is None else every
        if cadence == 1 and TRACE_EVERY_STEP and every_step is not None:
            return every_step(), None
        return opaque(phase.gate, cadence), cadence if phase.gated or cadence != base else None

    def close(self) -> None:
        """At detach: the phase's gate closes (compiled code that still runs measures nothing)."""
        self.phase.close()

    def training_forward(self, module: nn.Module) -> bool:
        """In a forward (pre-)hook of `module`, outside `guarded` (which turns gradients off): True
        when the forward in progress is a training forward (see `TrainingForwards`); False for
        evaluation, generation, no-grad forwards and activation-checkpoint recomputation."""
        return self.forwards.training(module)


class Probe:
    """Base class of a probe plug-in: keeps hook handles, removes them on detach, and guards hooks
    with `guarded`.

    A probe is one file with one subclass, registered with ``@stabkit.plugins.PROBES.register``; the
    Monitor builds it when one of its `families` is in `MonitorConfig.families`, calls `attach` once
    (register hooks through ``ctx.hooks``; record device tensors with ``ctx.recorder.add``),
    `end_step` at each `Monitor.step` before the step is committed, and `detach` at the end.
    """

    name = "probe"
    """Registry name (also the owner name of its hooks)."""
    families: frozenset[str] = frozenset()
    """The `MonitorConfig.families` it serves: built when any of them is on."""

    def __init__(self) -> None:
        self.handles: list[RemovableHandle] = []
        self.enabled = True
        self.ctx: ProbeContext | None = None
        self._watching = False

    def attach(self, ctx: ProbeContext) -> None:
        """Register hooks. Called once by the Monitor."""
        self.ctx = ctx

    def watch_forwards(self) -> None:
        """At attach, for probes with forward hooks: install the root hooks behind
        `ProbeContext.training_forward` (released at `detach`)."""
        assert self.ctx is not None
        if not self._watching:
            self.ctx.forwards.acquire()
            self._watching = True

    def end_step(self) -> None:
        """Called by the Monitor at `Monitor.step`, before the step's statistics are committed."""

    def finish_rows(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        """Called by the Monitor at each log interval with the host rows, after the host copy and the
        cross-rank reduction: add values computed from reduced ones (ratios of summed counts), in place."""

    def detach(self) -> None:
        """Remove every hook this probe registered (safe to call twice)."""
        for h in self.handles:
            h.remove()
        self.handles = []
        if self._watching and self.ctx is not None:
            self.ctx.forwards.release()
            self._watching = False

    def fail(self, where: str, exc: BaseException) -> None:
        """Warn once and disable this probe; with strict=True, raise instead."""
        if self.ctx is not None and self.ctx.config.strict:
            raise ProbeError(f"stabkit probe {self.name!r} failed at {where}: {exc}") from exc
        if self.enabled:
            hook_warning(
                f"stabkit: probe {self.name!r} failed at {where} ({type(exc).__name__}: {exc}); "
                "it is now disabled and training continues (MonitorConfig(strict=True) raises instead)",
                RuntimeWarning,
                stacklevel=3,
            )
        self.enabled = False


def guarded(method: F) -> F:
    """Decorator for probe hook methods: skip when disabled; route exceptions to `Probe.fail`."""

    @functools.wraps(method)
    def wrapper(self: Probe, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return None
        try:
            if torch.compiler.is_compiling():  # Dynamo traces the context manager
                with torch.no_grad():
                    return method(self, *args, **kwargs)
            # eager: the grad mode set directly (`torch.no_grad()` is a few Python frames per call,
            # and a hook body runs on every step)
            before = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)
            try:
                return method(self, *args, **kwargs)
            finally:
                torch._C._set_grad_enabled(before)
        except ProbeError:
            raise
        except Exception as exc:
            self.fail(method.__name__, exc)
            return None

    return wrapper  # type: ignore[return-value]


def reduce_plain(reduce: Callable[[torch.Tensor], T], x: torch.Tensor) -> T:
    """`reduce(x)` in a hook (eager), past any torch-function mode on the stack when `x` is a plain
    tensor: a hook of a module inside an attention module runs in its scope's mode
    (`stabkit.attention.scope`), which would see each of the reduction's tensor calls in Python
    (~30 µs more per 1 MiB output on a CPU), and no mode has business with stabkit's own reductions.
    A tensor subclass keeps its torch-function handling."""
    if type(x) is torch.Tensor and torch._C._is_torch_function_mode_enabled():
        with torch._C.DisableTorchFunction():
            return reduce(x)
    return reduce(x)


def first_tensor(output: Any) -> torch.Tensor:
    """The main tensor of a module output: the tensor itself, the first tensor of a tuple/list, or
    the first tensor value of a dict / ModelOutput. Raises TypeError when there is none."""
    tensor = first_tensor_in(output)
    if tensor is None:
        raise TypeError(f"module output of type {type(output).__name__} holds no tensor stabkit can read")
    return tensor


def select_modules(model: nn.Module, selection: ModuleSelection, default: list[str]) -> list[str]:
    """Module paths chosen by a MonitorConfig.modules selection (None = `default`)."""
    names = [n for n, _ in model.named_modules() if n]
    if selection is None:
        return [p for p in default if p]
    if isinstance(selection, str):
        chosen = [n for n in names if fnmatch.fnmatchcase(n, selection)]
        if not chosen:
            raise ValueError(f"MonitorConfig.modules={selection!r} matches no module of the model")
        return chosen
    if callable(selection):
        mods = dict(model.named_modules())
        return [n for n in names if selection(n, mods[n])]
    chosen = [n for n in names if any(fnmatch.fnmatchcase(n, pat) for pat in selection)]
    if not chosen:
        raise ValueError(f"MonitorConfig.modules={list(selection)!r} matches no module of the model")
    return chosen
