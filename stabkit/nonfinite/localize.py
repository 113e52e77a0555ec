"""Localization: which module, in which pass, produced the first NaN/Inf of a step.

`replay` runs in the optimizer pre-step hook of a step decided non-finite, before any update.
It re-runs each kept forward of the step (same inputs, RNG state and autocast settings) with a
`FiniteTracer` on, then its backward (from the kept dL/d(output), or the user's `loss_fn`), and
reports, in this order: a parameter that was already non-finite (an earlier update wrote it),
non-finite inputs, the first module that produced NaN/Inf in the forward pass, a non-finite
gradient arriving from the loss, the first producer in the backward pass, non-finite optimizer
state. Parameter gradients, buffers and RNG state are restored afterwards, so the step then
proceeds (or is skipped) as if the replay had not happened.

`locate_update_fault` runs at `Monitor.step` after the update check fired: it names the parameter
whose optimizer state or update is non-finite.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..events import Event
from ..probes import first_tensor
from ..stats.finite import floating_tensors, is_nonfinite, nonfinite_flag
from .guard import KeptForward, optimizer_tensors, rerun_forward, rng_state, set_rng_state
from .tracer import FiniteTracer

MAX_LISTED = 20


@dataclass
class FaultSite:
    """Where a non-finite value was produced."""

    pass_: str
    """'forward', 'backward', 'optimizer', 'input', 'loss' or 'unknown'."""
    module: str
    """Module path ('' = the root model)."""
    tensor: str
    """'output', 'grad_input', 'grad of <param>', 'optimizer state <key> of <param>', 'parameter <name>'..."""
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def where(self) -> str:
        """The module path, or a placeholder for the root / the data / the loss."""
        if self.pass_ == "input":
            return "(input)"
        if self.pass_ == "loss":
            return "(loss)"
        return self.module or "(model)"


def owner_of(param_name: str) -> str:
    """Module path that owns a parameter name ('blocks.0.attn.q_proj.weight' -> 'blocks.0.attn.q_proj')."""
    return param_name.rsplit(".", 1)[0] if "." in param_name else ""


def nonfinite_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> FaultSite | None:
    """The first parameter (model order) whose optimizer state or value is non-finite, read on the host."""
    state_tensors = optimizer_tensors(optimizer) if optimizer is not None else []
    fused = nonfinite_flag([*model.parameters(), *state_tensors])
    if fused is None or not bool(fused):  # sync point (on a hit only)
        return None
    faults: list[tuple[str, str]] = []
    for name, p in model.named_parameters():
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        keys = [k for k, v in state.items() if isinstance(v, torch.Tensor) and is_nonfinite(v)]
        if keys:
            faults.append((name, f"optimizer state {keys[0]} of {name}"))
        elif is_nonfinite(p):
            faults.append((name, f"parameter {name}"))
    if not faults:
        return None
    name, tensor = faults[0]
    return FaultSite(
        "optimizer", owner_of(name), tensor, details={"params": [n for n, _ in faults[:MAX_LISTED]]}
    )


def locate_update_fault(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> FaultSite:
    """After an update wrote NaN/Inf: which parameter, and whether its state or only the update is at fault."""
    found = nonfinite_state(model, optimizer)
    if found is None:
        return FaultSite(
            "optimizer", "", "parameters", note="the update check fired but no tensor is non-finite now"
        )
    if found.tensor.startswith("parameter "):
        found.tensor = "update of " + found.tensor[len("parameter ") :]
        found.note = (
            "the optimizer state is finite: the update itself was non-finite (learning rate, epsilon?)"
        )
    return found


def replay(
    model: nn.Module,
    forwards: list[KeptForward],
    optimizer: torch.optim.Optimizer | None,
    loss_fn: Callable[..., Any] | None = None,
) -> FaultSite:
    """Re-run the step's forwards and backwards with per-module checks; the first producer found.

    Costs one forward and backward per kept forward, with a device check per module; syncs with
    the host a few times. Call only on a step already decided non-finite.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    before = nonfinite_state(model, None)
    if before is not None:
        before.note = (
            "the parameter was non-finite before this step's forward: an earlier update (or code) wrote it"
        )
        return before
    saved_grads = [p.grad for p in params]
    saved_buffers = [(b, b.detach().clone()) for b in model.buffers()]
    saved_rng = rng_state()
    try:
        with warnings.catch_warnings(), torch.enable_grad():
            warnings.filterwarnings("ignore", message=".*backward hook.*")
            for p in params:
                p.grad = None
            for index, fwd in enumerate(forwards):
                found = _replay_one(model, fwd, loss_fn)
                if found is not None:
                    found.details["micro_batch"] = index
                    return found
    finally:
        for p, g in zip(params, saved_grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for b, copy in saved_buffers:
                b.copy_(copy)
        set_rng_state(*saved_rng)
    after = nonfinite_state(model, optimizer)
    if after is not None:
        after.note = "forward and backward were finite on replay; the optimizer state is not"
        return after
    note = "not reproduced by a replay of the step (transient fault, or a norm that overflowed)"
    if loss_fn is None and any(f.output_grad is None for f in forwards):
        note = (
            "the forward pass was finite on replay; the backward pass was not replayed "
            "(no output gradient kept: set keep_output_grad=True or pass loss_fn)"
        )
    return FaultSite("unknown", "", "", note=note)


def _replay_one(model: nn.Module, fwd: KeptForward, loss_fn: Callable[..., Any] | None) -> FaultSite | None:
    bad_input = nonfinite_flag(floating_tensors(fwd.args) + floating_tensors(fwd.kwargs), ignore_neginf=True)
    if bad_input is not None and bool(bad_input):  # sync point (replay only)
        return FaultSite("input", "", "input", note="the batch itself holds NaN/+Inf")
    backward = loss_fn is not None or fwd.output_grad is not None
    tracer = FiniteTracer(model, backward=backward)
    try:
        try:
            output = rerun_forward(model, fwd)
        except RuntimeError:  # full backward hooks refuse some in-place patterns: forward-only checks
            tracer.detach()
            tracer, backward = FiniteTracer(model, backward=False), False
            output = rerun_forward(model, fwd)
        site = tracer.result()
        if site is not None:
            return FaultSite(site[1], site[0], site[2])
        if not backward:
            return None
        tracer.reset()
        if loss_fn is not None:
            loss = loss_fn(output, *fwd.args, **fwd.kwargs)
            if not bool(torch.isfinite(loss.detach()).all()):  # sync point (replay only)
                return FaultSite(
                    "loss", "", "loss", note="loss_fn returned a non-finite loss from a finite output"
                )
            loss.backward()
        else:
            assert fwd.output_grad is not None
            if not bool(torch.isfinite(fwd.output_grad).all()):  # sync point (replay only)
                return FaultSite(
                    "loss",
                    "",
                    "grad of the model output",
                    note="the gradient arriving at the model output is non-finite: the loss computation produced it",
                )
            torch.autograd.backward(first_tensor(output), fwd.output_grad)
        site = tracer.result()
        return FaultSite(site[1], site[0], site[2]) if site is not None else None
    finally:
        tracer.detach()


def finding_event(step: int, finding: FaultSite | None, metric: str, value: float) -> Event:
    """A 'nonfinite' Event from a localization `finding`, or naming `metric` when there is none."""
    if finding is None:
        return Event(
            step,
            "nonfinite",
            metric,
            value,
            0.0,
            f"{metric} is not finite (not localized)",
            details={"metric": metric},
            severity="critical",
        )
    text = {
        "forward": f"{finding.where} produced NaN/Inf in its {finding.tensor} during the forward pass from finite inputs",
        "backward": f"{finding.where} produced a NaN/Inf {finding.tensor} during the backward pass from a finite grad_output",
        "optimizer": f"{finding.tensor} is NaN/Inf (optimizer)",
        "input": "the batch fed to the model holds NaN/Inf",
        "loss": f"{finding.tensor} is NaN/Inf while the model output was finite",
        "unknown": "a non-finite value was seen but not reproduced",
    }[finding.pass_]
    note = f"; {finding.note}" if finding.note else ""
    details = {
        "pass": finding.pass_,
        "module": finding.module,
        "tensor": finding.tensor,
        "metric": metric,
    }
    details.update(finding.details)
    return Event(
        step, "nonfinite", finding.where, value, 0.0, text + note, details=details, severity="critical"
    )
