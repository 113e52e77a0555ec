"""Discovery: find the Transformer roles in any model (`stabkit.inspect`)."""

from .inspect import OVERRIDE_KEYS, inspect
from .modelmap import AttentionMap, BlockMap, DiscoveryError, LogitsMap, ModelMap, NormMap

__all__ = [
    "OVERRIDE_KEYS",
    "AttentionMap",
    "BlockMap",
    "DiscoveryError",
    "LogitsMap",
    "ModelMap",
    "NormMap",
    "inspect",
]
