"""stabkit: keep large Transformer training runs from blowing up.

Attach hooks to any PyTorch Transformer (`attach`), read where its roles sit (`inspect_model`),
and watch per-layer stability statistics in TensorBoard.

`import stabkit` is light: the public names below (and the subpackages, e.g.
``stabkit.interventions``) load on first use (PEP 562, `stabkit.lazy`), so the CLI answers
``--help`` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .events import Event, InstabilityError
from .lazy import lazy

if TYPE_CHECKING:
    from .attaching import attach
    from .attention.kernels import register_kernel
    from .audit import audit
    from .config import MonitorConfig
    from .detectors import DetectConfig
    from .discovery import DiscoveryError, ModelMap, inspect_model
    from .interventions import z_loss
    from .moe.registry import register_router
    from .monitor import Monitor
    from .sinks.reader import load_run
else:
    # `stabkit.audit` names the function, not the subpackage of the same name. Importing a
    # subpackage sets it as an attribute of its parent the first time it loads; load the (light)
    # subpackage now and drop that attribute, so `__getattr__` hands out the function on first use.
    importlib.import_module(".audit", __name__)
    globals().pop("audit", None)

__version__ = "0.1.0"

_LAZY = {
    "audit": "audit",
    "MonitorConfig": "config",
    "DetectConfig": "detectors",
    "DiscoveryError": "discovery",
    "ModelMap": "discovery",
    "inspect_model": "discovery",
    "z_loss": "interventions",
    "Monitor": "monitor",
    "attach": "attaching",
    "register_kernel": "attention.kernels",
    "register_router": "moe.registry",
    "load_run": "sinks.reader",
}
"""Public name -> the submodule it comes from (imported on first access)."""

_SUBMODULES = frozenset(
    {
        "actions",
        "attention",
        "audit",
        "bench",
        "cli",
        "config",
        "detectors",
        "discovery",
        "distributed",
        "events",
        "harness",
        "integrations",
        "interventions",
        "hooks",
        "lifecycle",
        "moe",
        "monitor",
        "plugins",
        "probes",
        "sinks",
        "stats",
    }
)
"""Subpackages reachable as attributes after a bare ``import stabkit`` (e.g. ``stabkit.harness.models.GPT``,
``stabkit.interventions``)."""


__getattr__, __dir__ = lazy(__name__, _LAZY, _SUBMODULES)


__all__ = [
    "DetectConfig",
    "DiscoveryError",
    "Event",
    "InstabilityError",
    "ModelMap",
    "Monitor",
    "MonitorConfig",
    "__version__",
    "attach",
    "audit",
    "inspect_model",
    "load_run",
    "register_kernel",
    "register_router",
    "z_loss",
]
