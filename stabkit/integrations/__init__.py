"""Framework integrations: thin callbacks over `stabkit.attach`.

Import the one you use (each needs its framework installed):
`stabkit.integrations.hf.StabkitCallback` (transformers.Trainer, extra ``hf``) and
`stabkit.integrations.lightning.StabkitCallback` (Lightning, extra ``lightning``).
`Session` and `inner_optimizer` load on first use (PEP 562).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_names

if TYPE_CHECKING:
    from .session import Session, inner_optimizer

_LAZY = {"Session": "session", "inner_optimizer": "session"}

__getattr__ = lazy_names(__name__, _LAZY)


__all__ = ["Session", "inner_optimizer"]
