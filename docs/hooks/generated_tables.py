"""mkdocs hook: tables the code generates, written into the pages when the site is built, so the site
says what the installed stabkit does and cannot drift from it.

- ``<!-- stabkit:advice-table -->`` becomes the detectors' advice table — what `stabkit list advice`
  prints (`stabkit.detectors.advice.advice_table`): one row per event signature, with the detector
  kind that raises it, the interventions it names, when it applies and what to do.

Registered in mkdocs.yml (``hooks:``); runs once per page at build time (``mkdocs build`` / ``serve``).
tests/docs/test_guide_metrics.py checks the table against `advice_table()`.
"""

from __future__ import annotations

from typing import Any

ADVICE_MARKER = "<!-- stabkit:advice-table -->"


def _cell(text: str) -> str:
    """A table cell: pipes and brackets escaped (``param_groups[i]['lr']`` is no link), one line."""
    for char in "\\|[]*_`":
        text = text.replace(char, "\\" + char)
    return text.replace("\n", " ")


def advice_markdown() -> str:
    """The advice table as Markdown, in registry order (loads the detector classes)."""
    from stabkit.plugins import DETECTORS

    lines = [
        "| signature | detector | interventions | when | what to do |",
        "|---|---|---|---|---|",
    ]
    for cls in DETECTORS.classes():
        for key, row in cls.advice.items():
            names = ", ".join(f"`{n}`" for n in row.interventions) or "-"
            lines.append(f"| `{key}` | `{cls.kind}` | {names} | {_cell(row.when)} | {_cell(row.text)} |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """mkdocs event: fill the markers of a page before it is rendered."""
    if ADVICE_MARKER in markdown:
        markdown = markdown.replace(ADVICE_MARKER, advice_markdown())
    return markdown
