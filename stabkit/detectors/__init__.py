"""Detectors: pure plug-ins that read host values of named series and return events (spike, drift,
attention-entropy collapse, update-norm spikes, outlier onsets, depth-gradient imbalance, MoE expert
collapse, dead experts and router-z drift, and any registered one), the advice table they declare, the model-free
`Judge` that runs them, and the extension point of a kind that must see tensors (`device`). Each
plug-in's settings are an options dataclass in its own file (`SpikeOptions`, `DriftOptions`,
`EntropyOptions`). Importing this package loads no torch.

The kinds decided on the device (NaN/Inf, fp16 overflow) are `stabkit.nonfinite`; the orchestration
that runs detectors and actions at the right moment of a step is `stabkit.decisions.Decisions`,
built by the Monitor at attach.
"""

from ..detect_config import DetectConfig
from .advice import Advice, advice_table, advise, describe_advice
from .base import BlockInfo, Detector, DetectorContext, MoELayerInfo, Observation
from .depth_grad import DepthGradDetector, DepthGradOptions
from .device import DeviceChecks, DeviceContext
from .drift import DriftDetector, DriftOptions
from .entropy import EntropyCollapseDetector, EntropyOptions
from .judge import Judge
from .moe_collapse import CollapseOptions, ExpertCollapseDetector
from .moe_dead import DeadExpertsDetector, DeadOptions
from .outliers import OutlierDetector, OutlierOptions
from .router_z import RouterZDetector, RouterZOptions
from .spike import SpikeDetector, SpikeOptions
from .update_norm import UpdateNormDetector, UpdateNormOptions

__all__ = [
    "Advice",
    "BlockInfo",
    "CollapseOptions",
    "DeadExpertsDetector",
    "DeadOptions",
    "DepthGradDetector",
    "DepthGradOptions",
    "DetectConfig",
    "Detector",
    "DetectorContext",
    "DeviceChecks",
    "DeviceContext",
    "DriftDetector",
    "DriftOptions",
    "EntropyCollapseDetector",
    "EntropyOptions",
    "ExpertCollapseDetector",
    "Judge",
    "MoELayerInfo",
    "Observation",
    "OutlierDetector",
    "OutlierOptions",
    "RouterZDetector",
    "RouterZOptions",
    "SpikeDetector",
    "SpikeOptions",
    "UpdateNormDetector",
    "UpdateNormOptions",
    "advice_table",
    "advise",
    "describe_advice",
]
