"""STAND-IN for the ``flash_attn`` package (flash-attn 2, 2.8.x layout), pure PyTorch, for CPU tests.

Not the real library: see ``tests/standins/__init__.py``. Mirrors Dao-AILab/flash-attention @ 0251105a
``flash_attn/__init__.py``; importing it registers the ``flash_attn::*`` torch custom ops.
"""

__version__ = "2.8.4+standin"
__standin__ = True

from flash_attn.flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]
