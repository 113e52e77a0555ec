"""Switchable interventions on an existing model: z-loss, QK-norm, soft capping, norm relocation.

``handle = stabkit.interventions.apply(model, "qk_norm")`` performs reversible surgery and returns a
`Handle`; ``handle.remove()`` restores the model exactly. See `REGISTRY` / `describe_registry()`.
"""

from .handle import Handle, InterventionError, active_interventions
from .qknorm import HeadNorm, qk_norm_logit_bound, qk_norm_logit_bounds
from .registry import ORDER, REGISTRY, InterventionSpec, apply, apply_many, describe_registry
from .softcap_eager import capped_scores
from .zloss import z_loss

__all__ = [
    "ORDER",
    "REGISTRY",
    "Handle",
    "HeadNorm",
    "InterventionError",
    "InterventionSpec",
    "active_interventions",
    "apply",
    "apply_many",
    "capped_scores",
    "describe_registry",
    "qk_norm_logit_bound",
    "qk_norm_logit_bounds",
    "z_loss",
]
