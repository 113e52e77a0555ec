"""The readers of intercepted attention calls now live in `stabkit.attention.readers` (discovery and
the kernels share them); this module keeps the probe-side import path."""

from ..attention.call import LogitsCall, QKCall
from ..attention.readers import Reader, additive_allowed, read_mha, read_sdpa, read_softmax, sdpa_call, to4d

__all__ = [
    "LogitsCall",
    "QKCall",
    "Reader",
    "additive_allowed",
    "read_mha",
    "read_sdpa",
    "read_softmax",
    "sdpa_call",
    "to4d",
]
