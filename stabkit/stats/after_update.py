"""What the update-norm pass already learned about the finiteness of parameters and optimizer state
after an optimizer step, left for the non-finite check that runs right after it.

Both run in the optimizer's step post-hooks, probes' first (`stabkit.monitor`'s hook order): the
gradient probe's closed-form Adam(W) update norms (`stabkit.probes.updates`) read each parameter's
``exp_avg`` and ``exp_avg_sq`` (and, with decoupled weight decay, the parameter) a batch at a time;
their norms — and the norms of ``√v + ε`` — are NaN or ±Inf exactly when one of those entries is
(up to float32 overflow of a sum of squares past ~1e19 per entry, which a non-finite gradient
check shares). The non-finite watch (`stabkit.nonfinite.watch`) then reads only what that pass did
not: a second read of every parameter and both moments was most of its cost (on a GPT-2-sized
model, ~1 GB per step). A note is for one optimizer and one step; nothing is kept past it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

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


_NOTES: weakref.WeakKeyDictionary[Any, AfterUpdateNote] = weakref.WeakKeyDictionary()


def leave(optimizer: Any, step: int, seen: FiniteSeen) -> None:
    """The update-norm pass of `step` read `seen` (optimizer step post-hook, before the check)."""
    flag = any_flag(seen.flags)
    if flag is None:
        _NOTES.pop(optimizer, None)
        return
    _NOTES[optimizer] = AfterUpdateNote(step, frozenset(seen.tensors), flag)


def take(optimizer: Any, step: int) -> AfterUpdateNote | None:
    """The note `leave` left for `optimizer` at `step` (removed), None when there is none for it."""
    note = _NOTES.pop(optimizer, None)
    return note if note is not None and note.step == step else None
