"""What `stabkit.attach` checks and prepares before it wires anything, and the input check it puts
on the model: unwrap torch.compile / DDP wrappers, reset code compiled without stabkit's hooks,
refuse an optimizer holding foreign parameters, refuse an empty batch (a forward pre-hook)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from .hook_parking import dynamo_frames


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module under a `torch.compile` wrapper (hooks go on it; names match eager), else `model`."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model


_FRAMES_AT_RESET = [0]
"""Dynamo's frame count (`dynamo_frames`) when `forget_compiled_code` last reset compiled code:
process-wide, as Dynamo's cache is. Dynamo's counters survive ``torch._dynamo.reset()``."""


def forget_compiled_code(warn: bool = True) -> None:
    """At attach (and detach): when torch.compile has compiled code in this process since stabkit last
    reset it, drop it, so the next call recompiles with stabkit's hooks (Dynamo does not guard on
    module hooks by default, so code compiled before attach would run without them, and code
    compiled while attached would keep calling hooks detach removed). Warns at attach: compiled
    functions recompile once. Nothing compiled since the last reset (an attach after a detach, with
    no compile between): nothing to drop, no warning."""
    import sys

    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return
    frames = dynamo_frames()
    if frames in (0, _FRAMES_AT_RESET[0]):  # 0: nothing compiled, or the counters were cleared
        return
    dynamo.reset()
    _FRAMES_AT_RESET[0] = frames
    if warn:
        warnings.warn(
            "stabkit: torch.compile had compiled code in this process before attach; it was reset so that "
            "stabkit's hooks run (compiled models recompile once at their next call)",
            RuntimeWarning,
            stacklevel=4,
        )


def check_inputs(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook on the root: refuse an empty batch with a message that says what to do."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == 0:
            raise ValueError(
                f"stabkit: the model got an empty batch (input of shape {tuple(value.shape)}); "
                "skip empty batches in your data loader (drop_last=True, or filter zero-length sequences)"
            )


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
