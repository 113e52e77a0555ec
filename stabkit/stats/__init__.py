"""Statistics plumbing: fused device reductions and the per-interval host copy."""

from .recorder import Combine, Recorder, Reduction
from .reductions import l2_of_norms, logit_stats, tensor_stats

__all__ = ["Combine", "Recorder", "Reduction", "l2_of_norms", "logit_stats", "tensor_stats"]
