"""Discovery: find the Transformer roles in any model (`stabkit.inspect_model`)."""

from .inspect_model import OVERRIDE_KEYS, inspect_model
from .modelmap import AttentionMap, BlockMap, DiscoveryError, LogitsMap, ModelMap, NormMap

__all__ = [
    "OVERRIDE_KEYS",
    "AttentionMap",
    "BlockMap",
    "DiscoveryError",
    "LogitsMap",
    "ModelMap",
    "NormMap",
    "inspect_model",
]
