"""Switchable interventions on an existing model: z-loss, QK-norm, soft capping, norm relocation.

``handle = stabkit.interventions.apply(model, "qk_norm")`` performs reversible surgery and returns a
`Handle`; ``handle.remove()`` restores the model exactly. Each intervention is a plug-in
(`Intervention`, registered in `stabkit.plugins.INTERVENTIONS`: one file and one line there for a
built-in, ``@INTERVENTIONS.register`` for yours); `describe_registry()` lists them.
"""

from .base import Intervention, NoOptions, check_options, choices, option_defaults
from .handle import Handle, InterventionError, active_interventions
from .qknorm import HeadNorm, qk_norm_logit_bound, qk_norm_logit_bounds
from .registry import (
    ORDER,
    apply,
    apply_many,
    attach_optimizer,
    describe_registry,
    join_optimizer,
)
from .softcap_eager import capped_scores
from .zloss import z_loss

__all__ = [
    "ORDER",
    "Handle",
    "HeadNorm",
    "Intervention",
    "InterventionError",
    "NoOptions",
    "active_interventions",
    "apply",
    "apply_many",
    "attach_optimizer",
    "capped_scores",
    "check_options",
    "choices",
    "describe_registry",
    "join_optimizer",
    "option_defaults",
    "qk_norm_logit_bound",
    "qk_norm_logit_bounds",
    "z_loss",
]
