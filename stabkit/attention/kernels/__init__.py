"""Attention kernels stabkit recognises at their entry points: flash-attn 2 and 3, FlexAttention,
xformers, Transformer Engine, the aten SDPA ops, torch's varlen_attn — and any other kernel a user registers
(`register_kernel`). See `base` for how a call is recognised and `entry_points` for how Python-level
entry points become visible to function modes.
"""

from . import aten, flash, flex, te, varlen, xformers  # noqa: F401  (registers the built-in kernels)
from .base import KERNELS, Kernel, bind, hides_its_backward, is_op, lookup, map_qk, op_name, read_call, recall
from .custom import LAYOUTS, forget_kernel, register_kernel
from .entry_points import EntryPoints, install

__all__ = [
    "KERNELS",
    "LAYOUTS",
    "EntryPoints",
    "Kernel",
    "bind",
    "forget_kernel",
    "hides_its_backward",
    "install",
    "is_op",
    "lookup",
    "map_qk",
    "op_name",
    "read_call",
    "recall",
    "register_kernel",
]
