"""`NonfiniteWatch`: the device side of the 'nonfinite' kind — the checks that need the model.

What it owns and when each part runs:
- `StepGuard` (root forward pre-/post-hooks, every training forward): keeps the step's inputs for a
  replay and flags a non-finite model output; `FiniteTracer` with ``per_module`` (every module);
- `flag` (optimizer step pre-hook): one device flag from the global gradient norm (or the gradients
  themselves), the output flag and the tracer;
- `locate` (pre-hook, on a step decided non-finite): names the producer (tracer hit, or a replay);
- `check_update` (optimizer step post-hook): the fused parameter / optimizer-state check;
- `after_update` / `row_event` (at `Monitor.step` / at the log interval): the loss and the update
  check, and with an fp16 GradScaler a skipped step whose weights are broken.

It returns events; the decider advises them and runs the actions.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..detect_config import DetectConfig
from ..events import Event
from ..hooks import Registrar
from ..stats import Recorder
from ..stats.finite import nonfinite_flag
from .localize import FaultSite, finding_event, locate_update_fault, nonfinite_state, replay
from .nonfinite import OUTPUT_METRIC, UPDATE_METRIC, StepGuard, optimizer_tensors
from .tracer import FiniteTracer

GRAD_FLAG = "grad/nonfinite"
"""Recorded only when the grad probe is off: 1 when some gradient held NaN/Inf."""
Origin = tuple[torch.Tensor, torch.Tensor, list[tuple[str, str, str]]]


class NonfiniteWatch:
    """Device-side non-finite checks of one model (built by the wiring when 'nonfinite' runs)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: Any,
        config: DetectConfig,
        recorder: Recorder,
        hooks: Registrar,
        *,
        scaled: bool,
        can_replay: bool,
        muted: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self.recorder = recorder
        self.scaled = scaled
        """An fp16 GradScaler is in use: non-finite gradients are expected and handled by it."""
        self.can_replay = can_replay
        """Replays re-run forward/backward on this rank alone, which a distributed job cannot do."""
        self.muted = muted
        # the output gradient only serves a replay, and a replay only happens when non-finite values
        # are decided per step (warn-only decides at the log interval): keep it only then
        keep_grad = (
            config.keep_output_grad
            and config.loss_fn is None
            and config.localize
            and can_replay
            and config.needs_sync("nonfinite")
        )
        self.guard = StepGuard(model, self.record, config.check_output, keep_grad, hooks)
        self.tracer = FiniteTracer(model, hooks=hooks) if config.per_module else None
        self.open = False
        """A non-finite run of steps is in progress (replay and the unlocalized report happen once per run)."""
        self.now = False
        """This step was already reported non-finite."""
        self._update_bad: torch.Tensor | None = None
        self._origins: dict[int, Origin] = {}

    def record(self, name: str, value: Any) -> None:
        """Add a per-step flag (combined by max) to the recorder."""
        self.recorder.add(name, value, combine="max", reduction="max")

    # ------------------------------------------------------------------ before the update
    def flag(
        self, step: int, value: Callable[[str], torch.Tensor | None], record: bool
    ) -> torch.Tensor | None:
        """0-d device flag: this step is non-finite so far (None when nothing could be checked)."""
        origin: Origin | None = None
        if self.tracer is not None:
            hit, index = self.tracer.first()
            origin = (hit, index, list(self.tracer.sites))
            self._origins[step] = origin
            self.tracer.reset()
        flags = []
        norm = value("grad/global_norm")
        if self.scaled:
            pass  # fp16 GradScaler: overflowed gradients are its business (reported as amp/overflow)
        elif norm is not None:
            flags.append(~torch.isfinite(norm))
        else:
            grads = nonfinite_flag(p.grad for p in self.model.parameters() if p.grad is not None)
            if grads is not None:
                flags.append(grads)
                if record:
                    self.record(GRAD_FLAG, grads.float())
        if self.guard.output_bad is not None:
            flags.append(self.guard.output_bad)
        if origin is not None:
            flags.append(origin[0])
        if not flags:
            return None
        device = flags[0].device
        return torch.stack([f.to(device) for f in flags]).any()

    def locate(self, step: int) -> Event:
        """On a step decided non-finite before the update: the event, with the producer when found."""
        origin = self._origins.get(step)
        finding: FaultSite | None = None
        if origin is not None and bool(origin[0]):  # sync point (on a hit only)
            path, pass_, tensor = origin[2][int(origin[1])]  # sync point (on a hit only)
            finding = FaultSite(pass_, path, tensor)
        elif self.config.localize and self.can_replay and self.guard.forwards:
            finding = self._replay()  # starts with a cheap check for weights an earlier update broke
        repeat = self.open
        self.open = self.now = True
        event = finding_event(step, finding, "grad/global_norm", math.nan)
        if repeat:
            event.details["repeat"] = True
            event.message += " (the previous step was non-finite too)"
        return event

    def _replay(self) -> FaultSite:
        self.guard.paused = True
        try:
            with self.muted():  # the replay's statistics go nowhere
                return replay(self.model, self.guard.forwards, self.optimizer, self.config.loss_fn)
        finally:
            self.guard.paused = False
            if self.tracer is not None:
                self.tracer.reset()

    # ------------------------------------------------------------------ after the update
    def check_update(self, step: int, every: int) -> None:
        """Optimizer step post-hook: fused NaN/Inf check of parameters and optimizer state (device)."""
        if not every or step % every:
            return
        params = [p for p in self.model.parameters() if p.requires_grad]  # unfrozen ones too
        flag = nonfinite_flag([*params, *optimizer_tensors(self.optimizer)])
        if flag is not None:
            self.record(UPDATE_METRIC, flag.float())
            self._update_bad = flag

    def after_update_checks(self, committed: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """At `Monitor.step`: (name, device flag) pairs to copy to the host with the step's values."""
        checks: list[tuple[str, torch.Tensor]] = []
        if self._update_bad is not None:
            checks.append((UPDATE_METRIC, self._update_bad))
        if "loss" in committed:
            checks.append(("loss", ~torch.isfinite(committed["loss"])))
        return checks

    def after_update(self, step: int, bad: list[str]) -> Event | None:
        """The event for the flags that were set (`bad`: names from `after_update_checks`), if any."""
        if UPDATE_METRIC in bad and not self.now:
            self.open = self.now = True
            return finding_event(step, locate_update_fault(self.model, self.optimizer), UPDATE_METRIC, 1.0)
        if bad and not self.now:
            self.open = True
            return finding_event(step, None, bad[0], math.nan)
        return None

    def end_step(self) -> None:
        """At `Monitor.step`, after the decisions: release what the step kept."""
        self.now = False
        self._update_bad = None
        self.guard.end_step()

    # ------------------------------------------------------------------ at the log interval
    def row_event(self, step: int, row: dict[str, float]) -> Event | None:
        """Warn-only: the event of a logged row that holds a non-finite value (once per run of them)."""
        watched = ("loss",) if self.scaled else ("loss", "grad/global_norm")
        bad: list[str] = [m for m in watched if m in row and not math.isfinite(row[m])]
        bad += [m for m in (OUTPUT_METRIC, GRAD_FLAG, UPDATE_METRIC) if row.get(m, 0.0) > 0]
        origin = self._origins.pop(step, None)
        if not bad:
            self.open = False
            return None
        if self.open:
            return None
        self.open = True
        finding = None
        if origin is not None and bool(origin[0]):  # sync point (on a hit only)
            path, pass_, tensor = origin[2][int(origin[1])]  # sync point (on a hit only)
            finding = FaultSite(pass_, path, tensor)
        return finding_event(step, finding, bad[0], row[bad[0]])

    def forget_before(self, step: int) -> None:
        """Drop tracer origins of steps up to `step` (after their rows were judged)."""
        self._origins = {s: v for s, v in self._origins.items() if s > step}

    def detach(self) -> None:
        """Remove the guard's and tracer's hooks (safe twice)."""
        self.guard.detach()
        if self.tracer is not None:
            self.tracer.detach()


class ScalerCheck:
    """With an fp16 GradScaler: on a step it skipped, whether a parameter or optimizer state (not just
    a scaled gradient) holds NaN/Inf — then every step overflows and the scale alone cannot help.
    Runs at `Monitor.step` (even with the detectors off: it comes with `attach(..., scaler=...)`);
    syncs once, on overflowed steps only."""

    def __init__(self, model: nn.Module, optimizer: Any, overflowed: Callable[[], bool]) -> None:
        self.model = model
        self.optimizer = optimizer
        self.overflowed = overflowed

    def event(self, step: int) -> Event | None:
        """The 'nonfinite' event of a broken model behind a skipped step, else None."""
        if not self.overflowed():
            return None
        found = nonfinite_state(self.model, self.optimizer)
        if found is None:
            return None
        return Event(
            step,
            "nonfinite",
            found.module or "(model)",
            float("nan"),
            0.0,
            f"{found.tensor} holds NaN/Inf: the GradScaler skips every step because the weights (or the "
            "optimizer state) are broken, not because the loss scale is too high",
            details={"pass": "optimizer", "module": found.module, "tensor": found.tensor},
        )
