"""STAND-IN: ``flash_attn_3.flash_attn_interface`` re-exports the top-level ``flash_attn_interface`` stand-in.

Mirrors Dao-AILab/flash-attention @ 0251105a ``hopper/flash_attn_3/flash_attn_interface.py``.
"""

import flash_attn_interface as _flash_attn_interface
from flash_attn_interface import *  # noqa: F403

_flash_attn_forward = _flash_attn_interface._flash_attn_forward
_flash_attn_backward = _flash_attn_interface._flash_attn_backward
