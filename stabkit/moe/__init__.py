"""Mixture-of-experts routers: found by behaviour (`find`), described (`map`), registered by hand
when discovery cannot see them (`registry`), and measured per layer (`stabkit.moe.probe`,
`stabkit.moe.stats`, `stabkit.moe.finish`).

The names below load with their submodule on first use (PEP 562): `stabkit.discovery` imports
`stabkit.moe.map`, so this package imports nothing at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_names

if TYPE_CHECKING:
    from .map import MoEMap, Where
    from .registry import register_router, unregister_router

_LAZY = {
    "MoEMap": "map",
    "Where": "map",
    "register_router": "registry",
    "unregister_router": "registry",
}

__getattr__ = lazy_names(__name__, _LAZY)

__all__ = ["MoEMap", "Where", "register_router", "unregister_router"]
