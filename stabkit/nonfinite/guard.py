"""Per-step non-finite checks on the device, and what a replay needs kept from the step.

`StepGuard` puts two hooks on the root model:
- forward pre-hook (every forward with grad enabled): keeps the inputs *by reference*, the CPU
  and CUDA RNG states and the autocast settings, so the step can be replayed exactly — only when
  something can read them (`keep_inputs`: non-finite steps decided every step, or an action other
  than warn, which may dump or rescue the step); a warn-only run has no pre-hook;
- forward hook: the max of the model output, on the device (NaN if any NaN, +Inf if any +Inf:
  log Z = logsumexp is finite iff this max is, so this is the per-step log Z check at the cost of
  one read of the logits; the logits probe measures log Z itself only on sampled steps). With
  `keep_output_grad`, a tensor hook on the output keeps dL/d(output) until the optimizer pre-step
  hook releases it (one output-sized tensor; it lets the backward pass be replayed without the
  user's loss code).

Under ``torch.compile(model)`` the root's hooks are frames of their own, outside the model's graph;
when discovery found the module that yields the logits below the root, the output check runs in
that module's forward hook instead (inside the model's graph) and reads the logits there.

The device checks themselves are `stabkit.stats.finite.nonfinite_flag`.

Under ``torch.compile`` both hooks are traced into the model's graph. The RNG state cannot be read
there (``torch.get_rng_state`` breaks the graph), so a compiled forward is kept without it
(``rng_cpu`` None): its replay runs the eager module, whose dropout masks differ from Inductor's
random stream anyway. The kept forwards of a compiled step are chained (`_Chain`: each link points
to the previous one), not appended to a list, because Dynamo guards on a list's length — one graph
per micro-batch count — while a chain only tells "first forward of the step" from "a later one".
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..discovery.trace import tracing
from ..hook_parking import COMPILED_ONLY
from ..hooks import DIRECT, Registrar
from ..probes import first_tensor

if TYPE_CHECKING:
    from ..detectors.device import Record

MAX_KEPT = 256
"""Forward calls kept per step (micro-batches); older ones are dropped when Monitor.step is never called."""
OUTPUT_METRIC = "logits/nonfinite"
"""1 when the model output held NaN/+Inf in this step (so log Z was not finite), else 0."""
UPDATE_METRIC = "update/nonfinite"
"""1 when parameters or optimizer state held NaN/Inf after this step's update, else 0."""


@dataclass
class KeptForward:
    """One forward call of the step: inputs by reference, RNG and autocast state, output gradient."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng_cpu: torch.Tensor | None
    """None for a forward kept under torch.compile (its RNG state cannot be read in the graph)."""
    rng_cuda: list[torch.Tensor]
    autocast: list[tuple[str, torch.dtype]]
    output_grad: torch.Tensor | None = None


def rng_state() -> tuple[torch.Tensor, list[torch.Tensor]]:
    """CPU and (if initialised) every CUDA generator state; host-side copies, no device sync."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return torch.get_rng_state(), cuda


@dataclass
class _Chain:
    """A forward kept under torch.compile, and the one kept before it in the same step."""

    kept: KeptForward
    before: _Chain | None


def set_rng_state(cpu: torch.Tensor | None, cuda: list[torch.Tensor]) -> None:
    """Restore what `rng_state` returned (nothing for a compiled forward's missing state)."""
    if cpu is not None:
        torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


def autocast_state() -> list[tuple[str, torch.dtype]]:
    """(device type, dtype) of every autocast context active now."""
    out = []
    for dev in ("cpu", "cuda"):
        if torch.is_autocast_enabled(dev):
            out.append((dev, torch.get_autocast_dtype(dev)))
    return out


def rerun_forward(model: nn.Module, fwd: KeptForward) -> Any:
    """Run a kept forward again as it ran: its RNG state and autocast settings, its inputs (the
    caller restores the RNG afterwards). Used by the replay and by the rescue's before/after check."""
    set_rng_state(fwd.rng_cpu, fwd.rng_cuda)
    with contextlib.ExitStack() as stack:
        for device_type, dtype in fwd.autocast:
            stack.enter_context(torch.autocast(device_type, dtype=dtype))
        return model(*fwd.args, **fwd.kwargs)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every floating tensor in the optimizer state (e.g. Adam's exp_avg, exp_avg_sq)."""
    return [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


class StepGuard:
    """Root-model hooks that keep each forward of the step and check the output every step."""

    def __init__(
        self,
        model: nn.Module,
        record: Record,
        check_output: bool,
        keep_grad: bool,
        hooks: Registrar = DIRECT,
        output_site: tuple[str, Callable[[Any], Any]] | None = None,
        keep_inputs: bool = True,
        output_every: int = 1,
        step: Callable[[], int] | None = None,
    ) -> None:
        self.record = record
        self.check_output = check_output
        self.output_every = output_every
        """The output is checked on the eager steps that are multiples of it (traced: every step)."""
        self._step = step
        self.keep_inputs = keep_inputs
        """Keep each forward's inputs, RNG and autocast state (a replay, a dump or a rescue reads
        them). False when nothing can: no pre-hook then, and the output check is all the step costs."""
        self.keep_grad = keep_grad and keep_inputs
        self._kept: list[KeptForward] = []
        self._chain: _Chain | None = None
        self.output_bad: torch.Tensor | None = None
        """Device flag: some output of this step held NaN/+Inf."""
        self.paused = False
        """True during a replay: the hooks do nothing."""
        self.handles: list[RemovableHandle] = []
        if keep_inputs:
            self.handles.append(hooks.forward_pre("step-guard", model, self._pre_forward, with_kwargs=True))
        if keep_inputs or check_output:
            # only the output check: the hook is parked between the steps it checks (`hook_parking`)
            cadence = None if keep_inputs or output_every == 1 else output_every
            self.handles.append(
                hooks.forward("step-guard", model, self._post_forward, with_kwargs=True, cadence=cadence)
            )
        self._site_take: Callable[[Any], Any] | None = None
        if output_site is not None and check_output:
            path, self._site_take = output_site
            site = model.get_submodule(path)
            self.handles.append(hooks.forward("step-guard", site, self._site_forward, cadence=COMPILED_ONLY))

    @property
    def forwards(self) -> list[KeptForward]:
        """The forward calls kept in this step, oldest first (eager ones, then compiled ones)."""
        chained: list[KeptForward] = []
        link = self._chain
        while link is not None:
            chained.append(link.kept)
            link = link.before
        return self._kept + chained[::-1]

    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.paused or not torch.is_grad_enabled() or tracing():
            return
        if torch.compiler.is_compiling():  # traced: no RNG state, a chain instead of a list
            kept = KeptForward(args, dict(kwargs), None, [], autocast_state())
            self._chain = _Chain(kept, self._chain)
            return
        if len(self._kept) >= MAX_KEPT:  # Monitor.step is not being called: keep the newest only
            self._kept.pop(0)
        cpu, cuda = rng_state()
        self._kept.append(KeptForward(args, dict(kwargs), cpu, cuda, autocast_state()))

    def _latest(self) -> KeptForward | None:
        """The forward the pre-hook kept last (in the chain when traced)."""
        if torch.compiler.is_compiling():
            return None if self._chain is None else self._chain.kept
        return self._kept[-1] if self._kept else None

    def _post_forward(self, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if self.paused or not torch.is_grad_enabled() or tracing():
            return
        kept = self._latest()
        if kept is None and self.keep_inputs:
            return
        check = self.check_output and self._output_due()
        if not check and not (self.keep_grad and kept is not None):
            return  # a warn-only run's step between checked ones: nothing to read in the output
        try:
            out = first_tensor(output)
        except TypeError:
            return
        if check:
            self._check(out)
        if self.keep_grad and kept is not None and out.requires_grad:

            def keep(grad: torch.Tensor) -> None:
                kept.output_grad = grad.detach()

            out.register_hook(keep)

    def _output_due(self) -> bool:
        """In the root's forward hook: whether this forward's output is checked here — eager, on the
        steps of `output_every`; traced, every step, in the logits' own hook when there is one
        (`_site_forward`), else here (no step read in traced code: it would guard on it)."""
        if torch.compiler.is_compiling():
            return self._site_take is None
        return self.output_every == 1 or self._step is None or self._step() % self.output_every == 0

    def _site_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook of the module that yields the final logits: the output check, when traced.

        Under ``torch.compile(model)`` the root's own hooks run outside the model's graph, each
        compiled as a frame of its own, so a root hook with tensor work adds a graph; this hook runs
        inside the model's forward, and its check is part of the model's graph. Eager, the root hook
        checks (the model output itself) and this one returns at once."""
        if not torch.compiler.is_compiling() or self.paused or not torch.is_grad_enabled() or tracing():
            return
        if (self.keep_inputs and self._latest() is None) or self._site_take is None:
            return
        logits = self._site_take(output)
        if isinstance(logits, torch.Tensor):
            self._check(logits)

    def _check(self, out: torch.Tensor) -> None:
        """Flag (and record) NaN/+Inf in `out` from its max: device tensors only."""
        if not (out.is_floating_point() and out.numel() > 0):
            return
        with torch.no_grad():  # no graph: no detach needed
            top = out.amax()
            bad = (top < math.inf).logical_not_()  # NaN or +Inf, in two small ops
        self.output_bad = bad if self.output_bad is None else self.output_bad | bad
        if self.output_every > 1 and torch.compiler.is_compiling():  # traced every step: kept on its steps
            self.record(OUTPUT_METRIC, bad.float(), every=self.output_every)
        else:
            self.record(OUTPUT_METRIC, bad.float())

    def release_grads(self) -> None:
        """Drop the kept output gradients (at the optimizer pre-step hook, after any replay)."""
        for f in self.forwards:
            f.output_grad = None

    def end_step(self) -> None:
        """Forget the step (at Monitor.step)."""
        self._kept = []
        self._chain = None
        self.output_bad = None

    def detach(self) -> None:
        """Remove the hooks (safe twice)."""
        for h in self.handles:
            h.remove()
        self.handles = []
        self.end_step()
