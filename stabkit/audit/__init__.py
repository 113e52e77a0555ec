"""Architecture audit: `stabkit.audit(model, optimizer)` lists the choices that put a run at risk.

Runs once, before training. Each finding names the modules, the evidence read from the model,
why it matters (with a source) and the intervention or setting that addresses it.

The names below load on first use (PEP 562): importing this package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_names

if TYPE_CHECKING:
    from .context import AuditContext
    from .core import RULES, audit, describe_rules
    from .findings import INTERVENTIONS, Finding, Report
    from .memory import KVCache, MemorySummary

_LAZY = {
    "AuditContext": "context",
    "RULES": "core",
    "audit": "core",
    "describe_rules": "core",
    "INTERVENTIONS": "findings",
    "Finding": "findings",
    "Report": "findings",
    "KVCache": "memory",
    "MemorySummary": "memory",
}


__getattr__ = lazy_names(__name__, _LAZY)


__all__ = [
    "INTERVENTIONS",
    "RULES",
    "AuditContext",
    "Finding",
    "KVCache",
    "MemorySummary",
    "Report",
    "audit",
    "describe_rules",
]
