"""LayerNorm → RMSNorm: every layer norm of the model is swapped for a `stabkit.layers.RMSNorm` that
carries the *same* gain Parameter object (so the optimizer keeps working) and the same eps.

The layer norms are ``nn.LayerNorm`` and the classes discovery calls layer norms (`discovery.roles`
``norm_kind``: nanoGPT's own ``LayerNorm`` with ``weight`` and an optional ``bias``, HF ``*LayerNorm``
classes). Any module that is not a plain ``nn.LayerNorm`` (a subclass with its own forward, any other
class) is swapped only when a copy of it, run on two small random inputs with random gain and bias,
equals ``F.layer_norm(x, (d,), weight, bias, eps)`` over the last dim, d its gain's width and eps its
``eps`` attribute or, without one, the eps its output shows. A module that does not (HF
``T5LayerNorm`` is an RMSNorm; a ``LayerNorm2d`` normalises channels; a class holding its gain under
another name) is left as it is, and said in one warning; when no layer norm can be swapped the
intervention is refused.

RMSNorm has no bias and no mean subtraction. A LayerNorm bias is dropped: by default the swap is
refused when any bias is non-zero (checked once at apply time, one host sync); ``drop_bias=True``
drops them anyway (they then stop receiving gradients; they come back on remove). The original
modules are put back on remove. Runs at apply time only (the checks on copies too); the RMSNorms
then run in each forward.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..discovery.roles import is_norm, norm_kind
from ..layers import RMSNorm
from ..plugins import INTERVENTIONS
from .base import Intervention
from .common import keep_slow_path, norm_width, parent_of, swap_module
from .handle import Handle, InterventionError

NAME = "rmsnorm"
EPS_ATTRS = ("eps", "variance_epsilon", "epsilon", "layer_norm_eps")
COMMON_EPS = (1e-5, 1e-6, 1e-12, 1e-8, 1e-7, 1e-9, 1e-10, 1e-4, 1e-3, 1e-2)
"""The eps read off a module's output is rounded to one of these when within 5% of it."""
RTOL, ATOL = 1e-4, 1e-5
"""How closely a module's output must equal F.layer_norm (float64 inputs; float32 inside passes)."""


def _plain(module: nn.Module) -> bool:
    """An nn.LayerNorm computing nn.LayerNorm's own forward."""
    return isinstance(module, nn.LayerNorm) and type(module).forward is nn.LayerNorm.forward


def _is_layer_norm(module: nn.Module) -> bool:
    """nn.LayerNorm, or a class discovery calls a layer norm."""
    return isinstance(module, nn.LayerNorm) or (is_norm(module) and norm_kind(module) == "layernorm")


def _own_eps(module: nn.Module) -> float | None:
    for attr in EPS_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, float | int) and not isinstance(value, bool) and value >= 0:
            return float(value)
    return None


def _inputs(d: int) -> list[torch.Tensor]:
    """Two (2, 3, d) float64 inputs: unit scale with a mean offset, and a variance near the usual eps
    (so that eps shows in the output)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, d, generator=gen, dtype=torch.float64)
    y = torch.randn(2, 3, d, generator=gen, dtype=torch.float64)
    return [2.0 * x + 0.5, 3e-3 * y + 1e-2]


def _read_eps(probe: nn.Module, x: torch.Tensor) -> float | None:
    """The eps a layer norm with gain 1 and bias 0 shows on `x`: y = (x - mean) / sqrt(var + eps)."""
    with torch.no_grad():
        weight, bias = getattr(probe, "weight", None), getattr(probe, "bias", None)
        if isinstance(weight, torch.Tensor):
            weight.fill_(1.0)
        if isinstance(bias, torch.Tensor):
            bias.zero_()
        y = probe(x)
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    c = x - x.mean(-1, keepdim=True)
    r = (y.double() * c).sum(-1) / (c * c).sum(-1)  # 1 / sqrt(var + eps) per row
    if not bool((r > 0).all()):
        return None
    eps = float((1.0 / r.square() - c.square().mean(-1)).median().clamp_min(0.0))
    near = min(COMMON_EPS, key=lambda e: abs(e - eps))
    return near if abs(near - eps) <= 0.05 * near else eps


def _check(module: nn.Module, path: str) -> tuple[int, float] | str:
    """(width, eps) when `module` computes F.layer_norm over its last dim with its own ``weight`` and
    ``bias``; else why not."""
    if isinstance(module, nn.LayerNorm) and _plain(module):
        return int(module.normalized_shape[-1]), float(module.eps)
    others = sorted({n for n, _ in module.named_parameters()} - {"weight", "bias"})
    if others:
        return f"it holds parameters other than its own weight and bias ({', '.join(others[:3])})"
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    try:
        d = norm_width(module, NAME, path)
    except InterventionError as exc:
        return exc.missing
    for name, p in (("gain", weight), ("bias", bias)):
        if p is not None and not (isinstance(p, nn.Parameter) and tuple(p.shape) == (d,)):
            what = f"of shape {tuple(p.shape)}" if isinstance(p, torch.Tensor) else f"a {type(p).__name__}"
            return f"its {name} is {what}, not a ({d},) parameter"
    shape = getattr(module, "normalized_shape", None)
    if isinstance(shape, tuple | list | torch.Size) and len(shape) > 1:
        return f"it normalises over the last {len(shape)} dims"
    try:
        eps = _own_eps(module)
        if eps is None:
            eps = _read_eps(copy.deepcopy(module).double().cpu(), _inputs(d)[1])
        if eps is None:
            return "its output is not a layer norm of its input"
        probe = copy.deepcopy(module).double().cpu()
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            w, b = getattr(probe, "weight", None), getattr(probe, "bias", None)
            if isinstance(w, torch.Tensor):
                w.copy_(torch.rand(d, generator=gen, dtype=torch.float64) + 0.5)
            if isinstance(b, torch.Tensor):
                b.copy_(torch.rand(d, generator=gen, dtype=torch.float64) - 0.5)
            for x in _inputs(d):
                got = probe(x)
                want = F.layer_norm(x, (d,), w, b, eps)
                if not isinstance(got, torch.Tensor) or got.shape != want.shape:
                    return f"its output is not a tensor of its input's shape {tuple(x.shape)}"
                if not torch.allclose(got.double(), want, rtol=RTOL, atol=ATOL):
                    err = float((got.double() - want).abs().max())
                    return f"its output is not F.layer_norm over the last dim (off by up to {err:.2g})"
    except Exception as exc:  # a forward that wants other inputs, a copy that cannot run on CPU
        return f"a copy of it could not be run on a (2, 3, {d}) input ({type(exc).__name__}: {exc})"
    return d, eps


def _rms_from(module: nn.Module, d: int, eps: float) -> RMSNorm:
    rms = RMSNorm(d, eps=eps)
    shape = getattr(module, "normalized_shape", None) if _plain(module) else None
    rms.normalized_shape = tuple(shape) if shape is not None else (d,)
    weight = getattr(module, "weight", None)  # the same Parameter object (or None without a gain)
    rms.register_parameter("weight", weight if isinstance(weight, nn.Parameter) else None)
    return rms


def _sites(
    model: nn.Module,
) -> tuple[list[tuple[str, nn.Module, int, float]], list[tuple[str, nn.Module, str]]]:
    """The layer norms to swap (path, module, width, eps), outermost first, and those left (path,
    module, why)."""
    swap: list[tuple[str, nn.Module, int, float]] = []
    left: list[tuple[str, nn.Module, str]] = []
    checked: dict[int, tuple[int, float] | str] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        if not path or not _is_layer_norm(module):
            continue
        if any(path.startswith(p + ".") for p, *_ in swap):
            continue  # inside a layer norm swapped whole
        if id(module) not in checked:
            checked[id(module)] = _check(module, path)
        result = checked[id(module)]
        if isinstance(result, str):
            left.append((path, module, result))
        else:
            swap.append((path, module, *result))
    swapped = [p for p, *_ in swap]
    left = [
        (p, m, why) for p, m, why in left if not any(s.startswith(p + ".") for s in swapped)
    ]  # a wrapper whose inner layer norms are swapped is not left
    return swap, left


def _described(left: list[tuple[str, nn.Module, str]]) -> str:
    shown = "; ".join(f"{p} ({type(m).__name__}): {why}" for p, m, why in left[:3])
    return shown + (f"; and {len(left) - 3} more" if len(left) > 3 else "")


def apply_rmsnorm(model: nn.Module, drop_bias: bool = False, model_map_override: Any = None) -> Handle:
    """Swap every layer norm in `model` for an RMSNorm with the same gain (see the module docstring)."""
    sites, left = _sites(model)
    if not sites:
        if left:
            raise InterventionError(
                NAME,
                left[0][0],
                "no nn.LayerNorm found, and the modules named layer norms do not compute a layer norm "
                f"over their last dim that an RMSNorm could replace: {_described(left)}",
            )
        raise InterventionError(
            NAME, type(model).__name__, "no nn.LayerNorm found (does it use RMSNorm already?)"
        )
    if not drop_bias:
        biased = []
        for path, module, *_ in sites:
            bias = getattr(module, "bias", None)
            if isinstance(bias, torch.Tensor) and bool(bias.detach().ne(0).any()):  # sync point
                biased.append(path)
        if biased:
            raise InterventionError(
                NAME,
                biased[0],
                f"{len(biased)} LayerNorm(s) have a non-zero bias ({', '.join(biased[:3])}) that RMSNorm "
                "cannot carry; pass drop_bias=True to drop them",
            )
    handle = Handle(model, [NAME])
    swapped: dict[int, RMSNorm] = {}
    try:
        for path, module, d, eps in sites:
            if id(module) not in swapped:  # a LayerNorm shared by two parents stays shared
                swapped[id(module)] = _rms_from(module, d, eps)
            parent, name = parent_of(model, path)
            swap_module(handle, parent, name, swapped[id(module)])
            keep_slow_path(handle, model, path)
    except BaseException:
        handle.remove()
        raise
    if left:
        warnings.warn(
            f"stabkit: rmsnorm left {len(left)} module(s) named layer norms as they are (no RMSNorm can "
            f"replace them): {_described(left)}",
            RuntimeWarning,
            stacklevel=3,
        )
    return handle


@dataclass(frozen=True)
class RMSNormOptions:
    """The options of ``rmsnorm``."""

    drop_bias: bool = False
    """Drop the LayerNorms' non-zero biases (an RMSNorm cannot carry them) instead of refusing."""


@INTERVENTIONS.register
class RMSNormIntervention(Intervention):
    """``rmsnorm``: every LayerNorm becomes an RMSNorm with the same gain (norm surgery: applied first)."""

    name = NAME
    order = 10
    description = "swap every LayerNorm for an RMSNorm carrying the same gain (refuses non-zero biases unless drop_bias)"
    options_class = RMSNormOptions

    def apply(self, model: nn.Module, model_map: Any, options: RMSNormOptions) -> Handle:
        return apply_rmsnorm(model, options.drop_bias, model_map)
