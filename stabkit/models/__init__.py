"""The reference GPT the recipes train, its config and size presets."""

from .config import GPTConfig
from .gpt import GPT, Block
from .layers import RMSNorm, softcap
from .presets import PRESET_BATCH, PRESETS, preset_config

__all__ = ["GPT", "PRESETS", "PRESET_BATCH", "Block", "GPTConfig", "RMSNorm", "preset_config", "softcap"]
