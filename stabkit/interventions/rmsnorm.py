"""LayerNorm → RMSNorm: every ``nn.LayerNorm`` of the model is swapped for a `stabkit.harness.models.RMSNorm`
that carries the *same* gain Parameter object (so the optimizer keeps working) and the same eps.

RMSNorm has no bias and no mean subtraction. A LayerNorm bias is dropped: by default the swap is
refused when any bias is non-zero (checked once at apply time, one host sync); ``drop_bias=True``
drops them anyway (they then stop receiving gradients; they come back on remove). The original
modules are put back on remove. Runs at apply time only; the RMSNorms then run in each forward.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..layers import RMSNorm
from .common import keep_slow_path, parent_of, swap_module
from .handle import Handle, InterventionError

NAME = "rmsnorm"


def _rms_from(ln: nn.LayerNorm) -> RMSNorm:
    rms = RMSNorm(int(ln.normalized_shape[-1]), eps=ln.eps)
    rms.normalized_shape = tuple(ln.normalized_shape)  # type: ignore[assignment]
    rms.weight = ln.weight  # the same Parameter object (or None without elementwise_affine)
    return rms


def apply_rmsnorm(model: nn.Module, drop_bias: bool = False, model_map_override: Any = None) -> Handle:
    """Swap every nn.LayerNorm in `model` for an RMSNorm with the same gain (see the module docstring)."""
    sites = [
        (path, m) for path, m in model.named_modules(remove_duplicate=False) if isinstance(m, nn.LayerNorm)
    ]
    if not sites:
        raise InterventionError(
            NAME, type(model).__name__, "no nn.LayerNorm found (does it use RMSNorm already?)"
        )
    if not drop_bias:
        biased = [
            p for p, m in sites if m.bias is not None and bool(m.bias.detach().ne(0).any())
        ]  # sync point
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
        for path, ln in sites:
            if id(ln) not in swapped:  # a LayerNorm shared by two parents stays shared
                swapped[id(ln)] = _rms_from(ln)
            rms = swapped[id(ln)]
            parent, name = parent_of(model, path)
            swap_module(handle, parent, name, rms)
            keep_slow_path(handle, model, path)
    except BaseException:
        handle.remove()
        raise
    return handle
