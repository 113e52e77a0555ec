"""STAND-IN for the ``flash_attn_3`` package that the flash-attn 3 wheel installs (pure PyTorch, tests only).

Mirrors Dao-AILab/flash-attention @ 0251105a ``hopper/flash_attn_3/__init__.py``; the functions live in the
top-level ``flash_attn_interface`` stand-in module, as in the real wheel.
"""

__version__ = "3.0.0+standin"
__standin__ = True
