"""Probes: turn a training step into named statistics held as device tensors."""

from .activations import ActivationProbe
from .base import Probe, ProbeContext, ProbeError, first_tensor, guarded, select_modules
from .grads import GradProbe, parameter_units
from .logits import LogitProbe

__all__ = [
    "ActivationProbe",
    "GradProbe",
    "LogitProbe",
    "Probe",
    "ProbeContext",
    "ProbeError",
    "first_tensor",
    "guarded",
    "parameter_units",
    "select_modules",
]
