"""Apply-time check that a changed kernel call trains with the gradients of what it computes.

Runs once per attention module in `stabkit.interventions.verify`, after its traced forward, on the first
kernel call each intervention changed there (`stabkit.interventions.kernel_change` keeps it while
verifying). Outside any forward and any function mode: the call's floating-point tensor arguments
(q, k, v, or a packed qkv / kv) become fresh leaves, the change is applied to a copy of the call's
arguments as in training, and one backward of ``⟨output, r⟩`` (r random) gives the directional
derivative along a random direction d of the inputs. The reference is the changed forward itself: the
central difference ``(L(x + εd) − L(x − εd)) / 2ε``. A kernel whose backward does not see the change
(a cap or a q/k norm that reaches the forward only — the failure issue 38 names) differs from it by
tens of percent or more; a correct one agrees to rounding.

Nothing here touches the model's parameters, gradients or the global RNG (a private generator draws
r and d; the RNG state is restored around the calls). Calls with attention dropout are skipped (their
forward is random), and so are a call with no floating-point tensor argument and a kernel with no
backward on this device (FlexAttention on a CPU: training there cannot run its backward either).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from ..attention import kernels

STEP = {torch.float64: 1e-6, torch.float32: 1e-3}
"""Finite-difference step, relative to each input's RMS (16-bit inputs: 1e-2)."""
TOLERANCE = {torch.float64: 1e-5, torch.float32: 1e-2}
"""Largest relative disagreement of the two derivatives that passes (16-bit inputs: 0.1)."""


def _stochastic(arguments: dict[str, Any]) -> bool:
    for name in ("dropout_p", "p"):
        value = arguments.get(name)
        if isinstance(value, int | float) and value > 0:
            return True
    mod = arguments.get("self")
    return bool(getattr(mod, "training", False) and getattr(mod, "attention_dropout", 0.0) > 0)


def _first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return next(t for t in out if isinstance(t, torch.Tensor))


def directional_error(
    kernel: kernels.Kernel,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    change: Callable[[dict[str, Any]], None],
) -> tuple[float, float] | None:
    """(relative disagreement of autograd's directional derivative with the central difference of the
    changed call, the tolerance for its dtype), or None when the call cannot be checked."""
    bound = kernels.bind(kernel, fn, args, kwargs)
    names = [
        n
        for n, v in bound.arguments.items()
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() >= 3
    ]
    if not names or _stochastic(bound.arguments):
        return None
    x = {n: bound.arguments[n].detach() for n in names}
    dtype = x[names[0]].dtype
    device = x[names[0]].device
    gen = torch.Generator(device=device).manual_seed(0)

    def draw(t: torch.Tensor) -> torch.Tensor:
        return torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32).to(t.dtype)

    direction = {
        n: draw(t) * t.double().pow(2).mean().sqrt().clamp_min(1e-12).to(t.dtype) for n, t in x.items()
    }
    step = STEP.get(dtype, 1e-2)
    cotangent: list[torch.Tensor] = []

    def loss(values: dict[str, torch.Tensor]) -> torch.Tensor:
        arguments = dict(bound.arguments)
        arguments.update(values)
        change(arguments)
        call = inspect.BoundArguments(bound.signature, arguments)
        out = _first_tensor(fn(*call.args, **call.kwargs))
        if not cotangent:
            cotangent.append(draw(out).double())
        return (out.double() * cotangent[0]).sum()

    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        analytic, plus, minus = _derivatives(x, names, direction, step, loss, device, devices)
    except (NotImplementedError, RuntimeError):  # no backward here (FlexAttention on a CPU): unchecked
        return None
    numeric = (plus - minus) / (2 * step)
    scale = torch.maximum(analytic.abs(), numeric.abs()).clamp_min(1e-30)
    error = float((analytic - numeric).abs() / scale)  # sync point (apply time)
    return error, TOLERANCE.get(dtype, 0.1)


def _derivatives(
    x: dict[str, torch.Tensor],
    names: list[str],
    direction: dict[str, torch.Tensor],
    step: float,
    loss: Callable[[dict[str, torch.Tensor]], torch.Tensor],
    device: torch.device,
    devices: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(autograd's directional derivative, L(x + step·d), L(x − step·d)), the RNG state kept."""
    with torch.random.fork_rng(devices=devices), torch.enable_grad():
        leaves = {n: t.clone().requires_grad_() for n, t in x.items()}
        grads = torch.autograd.grad(loss(leaves), list(leaves.values()), allow_unused=True)
        analytic = sum(
            (
                (g.double() * direction[n].double()).sum()
                for n, g in zip(names, grads, strict=True)
                if g is not None
            ),
            torch.zeros((), dtype=torch.float64, device=device),
        )
        with torch.no_grad():
            plus = loss({n: t + step * direction[n] for n, t in x.items()})
            minus = loss({n: t - step * direction[n] for n, t in x.items()})
    return analytic, plus, minus
