"""What `stabkit.attach` checks and prepares before it wires anything, and the input test the forward
probes use: unwrap torch.compile / DDP wrappers, refuse an optimizer holding foreign parameters, find
an empty batch (`empty_input`: such a forward is not measured, `stabkit.probes.forwards`). Code
compiled without stabkit's hooks is reset by `stabkit.compiled_code.forget_compiled_code`."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module under a `torch.compile` wrapper (hooks go on it; names match eager), else `model`."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model


def empty_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    """The shape of the first input tensor of a forward that has dimensions but no element (an
    empty batch), else None. Runs in the root's forward pre-hook on the steps the forward probes
    sample (`stabkit.probes.forwards.TrainingForwards`)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == 0:
            return tuple(value.shape)
    return None


EMPTY_BATCH = (
    "stabkit: the model got an empty batch (input of shape {shape}); stabkit does not measure that "
    "forward (nor any later one with an empty input) and training goes on; skip empty batches in "
    "your data loader (drop_last=True, or filter zero-length sequences)"
)
"""The warning, once per monitor, when a sampled step's forward gets an empty batch."""


def check_optimizer(model: nn.Module, optimizer: Any) -> None:
    """Raise when the optimizer(s) hold parameters that are not in `model`; warn about trainable
    parameters that no optimizer holds (their gradients are monitored, but they never change)."""
    if optimizer is None:
        return
    mine = {id(p) for p in model.parameters()}
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    foreign = len(held - mine)
    if foreign:
        raise ValueError(
            f"stabkit.attach: the optimizer holds {foreign} parameter(s) that are not in the model; "
            "attach to the module that owns every optimized parameter (e.g. the wrapper, not a sub-module)"
        )
    orphans = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if orphans:
        more = f" and {len(orphans) - 3} more" if len(orphans) > 3 else ""
        warnings.warn(
            f"stabkit.attach: {len(orphans)} trainable parameter(s) are in no optimizer given to attach "
            f"({', '.join(orphans[:3])}{more}); pass every optimizer: attach(model, [opt1, opt2])",
            RuntimeWarning,
            stacklevel=4,
        )


def check_schedule(lr: float | None, warmup_steps: int | None) -> None:
    """At attach: the peak LR and warmup the caller gave are None (not known) or sensible."""
    if warmup_steps is not None and (not isinstance(warmup_steps, int) or warmup_steps < 0):
        raise ValueError(f"warmup_steps must be None (not known) or an integer >= 0, got {warmup_steps!r}")
    if lr is not None and not lr > 0:
        raise ValueError(f"lr must be None (not known) or a positive number, got {lr!r}")
