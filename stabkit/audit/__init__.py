"""Architecture audit: `stabkit.audit(model, optimizer)` lists the choices that put a run at risk.

Runs once, before training. Each finding names the modules, the evidence read from the model,
why it matters (with a source) and the intervention or setting that addresses it.
"""

from .context import AuditContext
from .core import RULES, audit, describe_rules
from .findings import INTERVENTIONS, Finding, Report
from .memory import KVCache, MemorySummary
from .spec import build_from_spec, run_inspect_cli, spec_names

__all__ = [
    "INTERVENTIONS",
    "RULES",
    "AuditContext",
    "Finding",
    "KVCache",
    "MemorySummary",
    "Report",
    "audit",
    "build_from_spec",
    "describe_rules",
    "run_inspect_cli",
    "spec_names",
]
