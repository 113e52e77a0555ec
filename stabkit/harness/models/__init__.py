"""The reference GPT the recipes train, its config and size presets.

The names below load with their submodule on first use (PEP 562): `stabkit.harness.models.presets` and
`stabkit.harness.models.config` (plain data) can be read without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...lazy import lazy_names

if TYPE_CHECKING:
    from .config import GPTConfig
    from .gpt import GPT, Block
    from .layers import RMSNorm, softcap
    from .presets import PRESET_BATCH, PRESETS, preset_config

_LAZY = {
    "GPTConfig": "config",
    "GPT": "gpt",
    "Block": "gpt",
    "RMSNorm": "layers",
    "softcap": "layers",
    "PRESET_BATCH": "presets",
    "PRESETS": "presets",
    "preset_config": "presets",
}


__getattr__ = lazy_names(__name__, _LAZY)


__all__ = ["GPT", "PRESETS", "PRESET_BATCH", "Block", "GPTConfig", "RMSNorm", "preset_config", "softcap"]
