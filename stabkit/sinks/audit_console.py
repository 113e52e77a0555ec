"""The audit's risks as a short block on the console, once at attach.

`ConsoleSink.write_record("audit", report)` calls `audit_block` with the audit's JSON form
(`stabkit.audit.Report.to_dict`) when `attach` has audited the model: a headline and one line per
risk (rule, where, the fixes). Notes are only counted: they are costs or departures from common
practice, not risks. A model with no risk prints nothing. Pure text; runs once per attach.
"""

from __future__ import annotations

from typing import Any

WHERE_SHOWN = 3
"""Module paths named per risk before '+N more'."""


def _where(paths: list[str]) -> str:
    if len(paths) <= WHERE_SHOWN:
        return ", ".join(paths) or "-"
    return f"{', '.join(paths[: WHERE_SHOWN - 1])}, +{len(paths) - WHERE_SHOWN + 1} more"


def audit_block(report: dict[str, Any]) -> str | None:
    """The console block for an audit report in its dict form; None when it found no risk."""
    findings = report.get("findings", [])
    risks = [f for f in findings if f.get("severity") == "risk"]
    if not risks:
        return None
    notes = len(findings) - len(risks)
    lines = [
        f"[stabkit] audit ({report.get('family', 'unknown')}): {len(risks)} risk(s), {notes} note(s) "
        "- details: `stabkit inspect --audit`, or the stabkit/audit text in TensorBoard"
    ]
    for f in risks:
        fixes = " | ".join(f.get("fix", [])) or "-"
        lines.append(f"[stabkit]   {f.get('rule')} at {_where(list(f.get('where', [])))} -> fix: {fixes}")
    return "\n".join(lines)
