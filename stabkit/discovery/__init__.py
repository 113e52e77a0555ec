"""Discovery: find the Transformer roles in any model (`stabkit.inspect`)."""

from .inspect import OVERRIDE_KEYS, inspect
from .modelmap import AttentionMap, BlockMap, DiscoveryError, ModelMap, NormMap

__all__ = ["OVERRIDE_KEYS", "AttentionMap", "BlockMap", "DiscoveryError", "ModelMap", "NormMap", "inspect"]
