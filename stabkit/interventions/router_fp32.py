"""``router_fp32``: each router's gate projection computed in float32, autocast off (ST-MoE's
"selective precision": the router's softmax and exponentials are where bfloat16 rounding hurts).

At apply time every router (`stabkit.interventions.router_site`) has its ``F.linear`` on the gate
weight replaced, in its forward only, by the same projection of the float32 input with float32
weights (casts that carry the gradient back to the parameters in their own dtype); the logits leave
in float32, so what the router makes from them (softmax, top-k, weights) is float32 too, up to where
the model casts them back. Without autocast and with float32 weights it computes exactly what it did.
Refused where the model's forward cannot take float32 routing weights (the apply-time check runs it).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..discovery.trace import Trace
from ..plugins import INTERVENTIONS
from .base import Intervention
from .handle import Handle
from .router_site import RouterHandle, check_sites, router_sites

NAME = "router_fp32"


def apply_router_fp32(model: nn.Module, model_map_override: Any = None) -> Handle:
    """Compute every router's gate projection in float32 (apply time)."""
    sites = router_sites(model, NAME, model_map_override)
    handle = RouterHandle(model, NAME, sites)
    for site in sites:
        site.fp32 = NAME
    return handle


@INTERVENTIONS.register
class RouterFP32Intervention(Intervention):
    """``router_fp32`` (see the module docstring). Goes on mid-run: it changes rounding only."""

    name = NAME
    order = 61
    description = "computes each MoE router's gate projection (and so its softmax and choice) in float32, autocast off (ST-MoE)"
    midrun = True
    midrun_preference = 60

    def apply(self, model: nn.Module, model_map: Any, options: Any) -> Handle:
        return apply_router_fp32(model, model_map)

    def verify(self, trace: Trace, model: nn.Module, handle: Handle) -> None:
        if isinstance(handle, RouterHandle):
            check_sites(self.name, handle, handle.sites, "gate")
