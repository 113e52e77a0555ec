"""Detectors: plug-ins that read host values of named series and return events (spike, drift,
attention-entropy collapse, fp16 overflow, non-finite), the advice table they declare, and the
model-free `Judge` that runs them. Importing this package loads no torch.

The wiring that connects them to a model (non-finite device checks, optimizer hooks, actions) is
`stabkit.detectors.wiring.DetectorSet`, built by the Monitor at attach.
"""

from ..detect_config import DetectConfig
from .advice import Advice, advice_table, advise, describe_advice
from .base import BlockInfo, Detector, DetectorContext, Observation
from .drift import DriftDetector
from .entropy import EntropyCollapseDetector, EntropyOptions
from .judge import Judge
from .spike import SpikeDetector

__all__ = [
    "Advice",
    "BlockInfo",
    "DetectConfig",
    "Detector",
    "DetectorContext",
    "DriftDetector",
    "EntropyCollapseDetector",
    "EntropyOptions",
    "Judge",
    "Observation",
    "SpikeDetector",
    "advice_table",
    "advise",
    "describe_advice",
]
