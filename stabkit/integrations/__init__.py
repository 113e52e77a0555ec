"""Framework integrations: thin callbacks over `stabkit.attach`.

Import the one you use (each needs its framework installed):
`stabkit.integrations.hf.StabkitCallback` (transformers.Trainer, extra ``hf``) and
`stabkit.integrations.lightning.StabkitCallback` (Lightning, extra ``lightning``).
`Session` and `inner_optimizer` load on first use (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .session import Session, inner_optimizer

_LAZY = {"Session": "session", "inner_optimizer": "session"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'stabkit.integrations' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


__all__ = ["Session", "inner_optimizer"]
