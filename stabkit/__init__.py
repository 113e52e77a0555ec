"""stabkit: keep large Transformer training runs from blowing up.

Attach hooks to any PyTorch Transformer (`attach`), read where its roles sit (`inspect`),
and watch per-layer stability statistics in TensorBoard.
"""

from .audit import audit
from .config import MonitorConfig
from .detectors import DetectConfig
from .discovery import DiscoveryError, ModelMap, inspect
from .events import Event, InstabilityError
from .interventions import z_loss
from .monitor import Monitor, attach

__version__ = "0.1.0"

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
    "inspect",
    "z_loss",
]
