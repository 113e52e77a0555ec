"""Text helpers for the audit report: compact path lists, evidence, plain and Markdown tables.

Run once, when a report is printed or logged.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Sequence
from typing import Any

_NUM = re.compile(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)")


def compact_paths(paths: Sequence[str], limit: int = 4) -> str:
    """Join module paths, folding repeated blocks: ``blocks.{0..11}.attn`` for 12 paths."""
    if not paths:
        return "-"
    groups: dict[str, list[str]] = {}
    for p in paths:
        groups.setdefault(_NUM.sub("*", p), []).append(p)
    shown = [_fold(pattern, members) for pattern, members in groups.items()]
    if len(shown) > limit:
        shown = [*shown[:limit], f"+{len(shown) - limit} more"]
    return ", ".join(shown)


def _fold(pattern: str, members: list[str]) -> str:
    if len(members) == 1:
        return members[0]
    if pattern.count("*") != 1:
        return f"{pattern} ({len(members)})"
    indices = sorted({int(_NUM.findall(m)[0]) for m in members if _NUM.findall(m)})
    if indices and indices == list(range(indices[0], indices[-1] + 1)):
        span = f"{{{indices[0]}..{indices[-1]}}}"
    else:
        span = "{" + ",".join(map(str, indices)) + "}"
    return pattern.replace("*", span)


def fmt_value(value: Any) -> str:
    """Short text of one evidence value."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 10_000 else str(value)
    if isinstance(value, list | tuple):
        items = [fmt_value(v) for v in value[:6]]
        more = f", +{len(value) - 6}" if len(value) > 6 else ""
        return "[" + ", ".join(items) + more + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {fmt_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def evidence_text(evidence: dict[str, Any]) -> str:
    """``key=value, key=value`` for a finding's evidence."""
    return ", ".join(f"{k}={fmt_value(v)}" for k, v in evidence.items()) or "-"


def text_table(rows: Sequence[tuple[str, str, str, str, str, str]], width: int = 110) -> str:
    """A plain-text table: severity and rule columns, then where / evidence / why / fix lines."""
    rule_w = max(len("rule"), *(len(r[1]) for r in rows))
    indent = 6 + rule_w + 2
    body_w = max(40, width - indent)
    lines = [f"{'sev':<6}{'rule':<{rule_w}}  where / evidence / why / fix", "-" * min(width, indent + body_w)]
    for sev, rule, where, evidence, why, fix in rows:
        first = True
        for label, text in (("where", where), ("evidence", evidence), ("why", why), ("fix", fix)):
            wrapped = textwrap.wrap(text, body_w - 10, break_on_hyphens=False, break_long_words=False) or [
                "-"
            ]
            for i, chunk in enumerate(wrapped):
                head = f"{sev:<6}{rule:<{rule_w}}  " if first else " " * indent
                tag = f"{label + ':':<10}" if i == 0 else " " * 10
                lines.append(f"{head}{tag}{chunk}")
                first = False
        lines.append("")
    return "\n".join(lines).rstrip()


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table; pipes and newlines inside cells are escaped."""

    def cell(x: str) -> str:
        return str(x).replace("|", "\\|").replace("\n", " ")

    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(out)
