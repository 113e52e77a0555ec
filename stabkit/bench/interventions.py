"""Intervention variants of `stabkit bench`: the bare loop with one intervention switched on and no
monitor, so its ratio to ``bare`` is what the intervention itself costs per step.

``qk_clip`` (`stabkit bench --variants bare,default,qk_clip`): QK-Clip at K2's τ = 100, watching
the optimizer. Its cost is the exact per-head max (`stabkit.interventions.qkclip_max`): one extra
float32 ``q·kᵀ`` per attention call in every training forward, in blocks within
``QKClipOptions.chunk_bytes``, plus the clip after each step (a comparison per head; the row scaling
only for heads past τ — at the bench's LR none is, so the figure is the steady state K2 describes,
after clipping has gone quiet).

When it runs: `run_bench` (and the memory phase's fresh process) calls `apply_variant` once per
variant's trainer, before any step; `remove` at the end.
"""

from __future__ import annotations

from typing import Any

from torch import nn

INTERVENTION_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {"qk_clip": ("qk_clip", {"tau": 100.0})}
"""Bench variant -> (intervention, options). Not in the default ``--variants``: name them to measure them."""


def apply_variant(model: nn.Module, optimizer: Any, variant: str) -> Any:
    """Switch on `variant`'s intervention on `model` (watching `optimizer`); its handle, or None for a
    variant that is not an intervention."""
    spec = INTERVENTION_VARIANTS.get(variant)
    if spec is None:
        return None
    from ..interventions import apply

    name, options = spec
    handle = apply(model, name, **options)
    watch = getattr(handle, "watch", None)
    if watch is not None:  # qk_clip clips after each optimizer step
        watch(optimizer)
    return handle
