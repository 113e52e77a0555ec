"""`StepFacts`: what the step in progress knows, in one typed object the Monitor owns and hands to the
plug-ins that learn or use it — the probes (`ProbeContext.facts`) and the detectors' device parts
(`DeviceContext.facts`). Built once at attach; no process-global state carries data between plug-ins.

- ``scaler``, ``dist``: fixed at attach (the fp16 GradScaler `attach` was given; the rank's place in a
  torchrun job).
- ``update_skipped``: set by the gradient probe at `Monitor.step` (the GradScaler skipped this step's
  update); read right after by the AMP check (`stabkit.nonfinite.scaler`).
- the after-update note (`leave_after_update` / `take_after_update`): what the update-norm pass already
  learned about the finiteness of parameters and optimizer state after an optimizer step, left for the
  non-finite check that runs right after it.

Both of the latter run in the optimizer's step post-hooks, probes' first (`stabkit.monitor`'s hook order): the
gradient probe's closed-form Adam(W) update norms (`stabkit.probes.updates`) read each parameter's
``exp_avg`` and ``exp_avg_sq`` (and, with decoupled weight decay, the parameter) a batch at a time;
their norms — and the norms of ``√v + ε`` — are NaN or ±Inf exactly when one of those entries is
(up to float32 overflow of a sum of squares past ~1e19 per entry, which a non-finite gradient
check shares). The non-finite watch (`stabkit.nonfinite.watch`) then reads only what that pass did
not: a second read of every parameter and both moments was most of its cost (on a GPT-2-sized
model, ~1 GB per step). A note is for one optimizer and one step; nothing is kept past it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..distributed.context import SINGLE, DistContext
from .finite import any_flag


@dataclass
class FiniteSeen:
    """Filled by the update-norm pass: which tensors it read after the update, and its flags."""

    tensors: set[int] = field(default_factory=set)
    """``id`` of each parameter and optimizer-state tensor read (the optimizer's own objects)."""
    flags: list[torch.Tensor] = field(default_factory=list)
    """0-d bool device tensors: some tensor read holds NaN/±Inf."""


@dataclass(frozen=True)
class AfterUpdateNote:
    step: int
    tensors: frozenset[int]
    flag: torch.Tensor


@dataclass
class StepFacts:
    """What the step in progress knows (see the module docstring for who writes and reads each part)."""

    scaler: Any | None = None
    """The fp16 GradScaler `attach` was given (None: none)."""
    dist: DistContext = SINGLE
    """This rank's place in a torchrun job (`SINGLE` without one)."""
    update_skipped: bool = False
    """The GradScaler skipped this step's update (set by the gradient probe at `Monitor.step`)."""
    _note: AfterUpdateNote | None = None

    @property
    def scaled(self) -> bool:
        """An enabled fp16 GradScaler is in use (its skipped steps are its business)."""
        return self.scaler is not None and bool(self.scaler.is_enabled())

    def leave_after_update(self, step: int, seen: FiniteSeen) -> None:
        """The update-norm pass of `step` read `seen` (optimizer step post-hook, before the check)."""
        flag = any_flag(seen.flags)
        self._note = None if flag is None else AfterUpdateNote(step, frozenset(seen.tensors), flag)

    def take_after_update(self, step: int) -> AfterUpdateNote | None:
        """The note left at `step` (removed), None when there is none for this step."""
        note, self._note = self._note, None
        return note if note is not None and note.step == step else None
