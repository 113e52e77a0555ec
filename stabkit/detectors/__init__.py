"""Detectors and actions: NaN/Inf localization, spike and drift detection, advice, skip and rollback.

`install(monitor, DetectConfig(...))` plugs them into a Monitor; `describe_advice()` is the table
`stabkit list advice` prints. Only `DetectConfig` is imported eagerly, so `stabkit.config` can
import it without a cycle (everything else loads on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_names
from .config import ACTIONS, KINDS, DetectConfig

if TYPE_CHECKING:
    from .advice import ADVICE, Advice, advise, describe_advice
    from .drift import DriftDetector
    from .localize import Finding, locate_update_fault, replay
    from .snapshots import Snapshot, SnapshotStore
    from .spike import SpikeDetector
    from .tracer import FiniteTracer
    from .wiring import DetectorHandle, install

_LAZY = {
    "ADVICE": "advice",
    "Advice": "advice",
    "advise": "advice",
    "describe_advice": "advice",
    "DriftDetector": "drift",
    "Finding": "localize",
    "locate_update_fault": "localize",
    "replay": "localize",
    "Snapshot": "snapshots",
    "SnapshotStore": "snapshots",
    "SpikeDetector": "spike",
    "FiniteTracer": "tracer",
    "DetectorHandle": "wiring",
    "install": "wiring",
}


__getattr__ = lazy_names(__name__, _LAZY)


__all__ = [
    "ACTIONS",
    "ADVICE",
    "KINDS",
    "Advice",
    "DetectConfig",
    "DetectorHandle",
    "DriftDetector",
    "Finding",
    "FiniteTracer",
    "Snapshot",
    "SnapshotStore",
    "SpikeDetector",
    "advise",
    "describe_advice",
    "install",
    "locate_update_fault",
    "replay",
]
