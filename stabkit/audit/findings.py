"""Finding and Report: what the audit found, with evidence, source and fix.

Built once by `stabkit.audit` (before training); read by the CLI, `attach` (TensorBoard text and
the JSONL log) and by users. Nothing here touches tensors.
"""

from __future__ import annotations

import json
import numbers
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ..plugins import INTERVENTIONS as _INTERVENTIONS
from ..plugins import LiveNames
from .format import compact_paths, evidence_text, markdown_table, text_table

if TYPE_CHECKING:
    from .memory import MemorySummary

Severity = Literal["risk", "note"]
SEVERITIES: tuple[str, ...] = ("risk", "note")

INTERVENTIONS = LiveNames(_INTERVENTIONS.names)
"""Registry names of `stabkit.interventions` that a fix may name: read live from
`stabkit.plugins.INTERVENTIONS` (names only, nothing imported), so a plug-in registered after import
counts."""

_FIX = re.compile(r"^(?P<name>[a-z_]+)(?:\((?P<opts>[^)]*)\))?$")


@dataclass
class Finding:
    """One choice in the model or optimizer that puts a run at risk (or is worth knowing)."""

    rule: str
    """Id of the rule that produced it (a key of `stabkit.audit.RULES`)."""
    severity: Severity
    """'risk' (likely to hurt training) or 'note' (a cost or a departure from common practice)."""
    where: list[str]
    """Module paths (or parameter names, or ``optimizer.param_groups[i]``) it concerns."""
    evidence: dict[str, Any]
    """Values read from the model or optimizer: shapes, flags, hyper-parameters (JSON-ready)."""
    why: str
    """One sentence, with its source (a paper or 'practice')."""
    fix: list[str]
    """Alternatives, each an intervention (``qk_norm``, ``norm_placement(to=pre)``) or a setting."""

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"Finding.severity must be one of {SEVERITIES}, got {self.severity!r}")
        if not self.fix or not self.why:
            raise ValueError(f"Finding {self.rule!r} needs a non-empty `why` and at least one `fix`")

    @property
    def interventions(self) -> list[tuple[str, dict[str, str]]]:
        """The fixes that are stabkit interventions, as (registry name, options)."""
        out: list[tuple[str, dict[str, str]]] = []
        for f in self.fix:
            m = _FIX.match(f)
            if m and m["name"] in INTERVENTIONS:
                opts = dict(kv.split("=", 1) for kv in (m["opts"] or "").split(",") if "=" in kv)
                out.append((m["name"], {k.strip(): v.strip() for k, v in opts.items()}))
        return out

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "rule": self.rule,
            "severity": self.severity,
            "where": list(self.where),
            "evidence": _jsonable(self.evidence),
            "why": self.why,
            "fix": list(self.fix),
        }


@dataclass
class Report:
    """The audit of one model (and optimizer): findings plus a memory summary."""

    findings: list[Finding]
    memory: MemorySummary | None = None
    family: str = "unknown"
    """The discovery family of the model."""
    inputs: dict[str, Any] = field(default_factory=dict)
    """What the audit was told: lr, warmup_steps, seq_len, active interventions, optimizer class."""

    @property
    def risks(self) -> list[Finding]:
        """Findings with severity 'risk'."""
        return [f for f in self.findings if f.severity == "risk"]

    @property
    def notes(self) -> list[Finding]:
        """Findings with severity 'note'."""
        return [f for f in self.findings if f.severity == "note"]

    def by_rule(self, rule: str) -> list[Finding]:
        """Findings of one rule."""
        return [f for f in self.findings if f.rule == rule]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what `stabkit inspect --audit --json` prints and the JSONL log keeps)."""
        return {
            "family": self.family,
            "inputs": _jsonable(self.inputs),
            "summary": {"risks": len(self.risks), "notes": len(self.notes)},
            "findings": [f.to_dict() for f in self.findings],
            "memory": self.memory.to_dict() if self.memory is not None else None,
        }

    def to_json(self, indent: int | None = 2) -> str:
        """`to_dict` as a JSON string."""
        return json.dumps(self.to_dict(), indent=indent)

    def headline(self) -> str:
        """One line: counts of risks and notes."""
        return f"stabkit audit ({self.family}): {len(self.risks)} risk(s), {len(self.notes)} note(s)"

    def to_text(self) -> str:
        """A readable table (severity, rule, where, evidence, why, fix), then the memory summary."""
        rows = [
            (f.severity, f.rule, compact_paths(f.where), evidence_text(f.evidence), f.why, " | ".join(f.fix))
            for f in self._sorted()
        ]
        parts = [self.headline(), text_table(rows) if rows else "no findings"]
        if self.memory is not None:
            parts.append(self.memory.to_text())
        return "\n\n".join(parts)

    def to_markdown(self) -> str:
        """Markdown (TensorBoard text): a findings table and the memory summary."""
        rows = [
            (
                f"**{f.severity}**",
                f"`{f.rule}`",
                compact_paths(f.where),
                evidence_text(f.evidence),
                f.why,
                ", ".join(f"`{x}`" for x in f.fix),
            )
            for f in self._sorted()
        ]
        parts = [f"### {self.headline()}"]
        if rows:
            parts.append(markdown_table(("severity", "rule", "where", "evidence", "why", "fix"), rows))
        if self.memory is not None:
            parts.append(self.memory.to_markdown())
        return "\n\n".join(parts)

    def _sorted(self) -> list[Finding]:
        return sorted(self.findings, key=lambda f: SEVERITIES.index(f.severity))


def _jsonable(value: Any) -> Any:
    """Convert evidence values (tuples, dtypes, numpy/torch scalars) to JSON types."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = sorted(value) if isinstance(value, set | frozenset) else value
        return [_jsonable(v) for v in items]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return str(value)  # dtypes, devices, anything else: its name
