"""The learning rate the optimizer applies at this step, as the rate-based detectors read it.

Read by `stabkit.decisions` in the optimizer step pre-hook (the rate of the update about to be
made, after any scheduler call of the previous step) and logged as the ``opt/lr`` series beside the
step's statistics. Detectors that judge an update (`update/*` series) divide by it, so a warmup
ramp or a decay is not mistaken for a change of the run; `depth_grad` reads its first steps to
tell a warmup. A host read of ``param_groups[i]["lr"]``: no device sync (an LR held as a tensor on
an accelerator is not read: None).
"""

from __future__ import annotations

from typing import Any

LR_SERIES = "opt/lr"
"""The series name of the optimizer's learning rate (its first parameter group that holds parameters)."""


def current_lr(optimizer: Any) -> float | None:
    """The learning rate of the first parameter group of `optimizer` that holds parameters (an
    `OptimizerSet`: of its first optimizer), or None (no optimizer, no 'lr' key, an accelerator
    tensor)."""
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return None
    group = next((g for g in groups if g.get("params")), groups[0])
    lr = group.get("lr")
    if hasattr(lr, "device") and hasattr(lr, "numel"):  # a tensor (torch is not imported by the detectors)
        if lr.device.type != "cpu" or lr.numel() != 1:
            return None
        return float(lr)
    return float(lr) if isinstance(lr, (int, float)) else None
