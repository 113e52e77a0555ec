"""Statistics plumbing: fused device reductions and the per-interval host copy."""

from .outliers import outlier_stats
from .recorder import Combine, Recorder, Reduction
from .reductions import foreach_norm_f32, l2_of_norms, logit_stats, norm_f32, tensor_stats

__all__ = [
    "Combine",
    "Recorder",
    "Reduction",
    "foreach_norm_f32",
    "l2_of_norms",
    "logit_stats",
    "norm_f32",
    "outlier_stats",
    "tensor_stats",
]
