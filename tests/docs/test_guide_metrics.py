"""The metrics page (docs/guide/metrics.md) documents every metric stabkit emits, names only detectors and
advice signatures that exist, and its advice table is the detectors' own (filled in by the mkdocs hook)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import torch
import yaml
from zoo import reference_gpt, train_steps

import stabkit
from stabkit.detectors.advice import advice_table
from stabkit.plugins import DETECTORS, INTERVENTIONS

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "guide" / "metrics.md"
HOOK = ROOT / "docs" / "hooks" / "generated_tables.py"


def _hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generated_tables", HOOK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(markdown: str) -> list[list[str]]:
    """The body rows of every Markdown table, as cells (escaped pipes kept inside their cell)."""
    rows = []
    for line in markdown.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]])
    return [r for r in rows if r[0] not in ("metric", "signature")]


def documented_patterns() -> list[re.Pattern[str]]:
    """One regex per metric name in the first column of the page's tables (``<x>``: one path part)."""
    patterns = []
    for row in _rows(PAGE.read_text()):
        for name in re.findall(r"`([^`]+)`", row[0]):
            patterns.append(
                re.compile(
                    "^"
                    + re.sub(r"<[^>]+>", "[^/]+", re.escape(name).replace(r"\<", "<").replace(r"\>", ">"))
                    + "$"
                )
            )
    return patterns


def emitted_names() -> set[str]:
    """Every metric of a full-monitoring run with per-head attention, a soft cap, z-loss and QK-Clip."""
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = stabkit.MonitorConfig.full(attn_per_head=True, console=False)
    fixes = ["attn_softcap", "z_loss", ("qk_clip", {"tau": 1.0})]
    with stabkit.attach(model, opt, config=cfg, interventions=fixes) as mon:
        train_steps(model, opt, mon, 3)
    return {name for _, row in mon.history for name in row}


def test_every_emitted_metric_is_documented() -> None:
    patterns = documented_patterns()
    names = emitted_names()
    assert len(names) > 80  # the run above emits the whole vocabulary
    missing = sorted(n for n in names if not any(p.match(n) for p in patterns))
    assert missing == []


def test_the_page_names_only_detectors_and_signatures_that_exist() -> None:
    text = PAGE.read_text()
    kinds = set(DETECTORS.names())
    bold = set(re.findall(r"\*\*([a-z_]+)\*\*", text))
    assert bold and bold <= kinds, bold - kinds
    signatures = set(advice_table())
    after_arrows = [m for row in _rows(text) for m in re.findall(r"→ ((?:`[a-z_]+`(?: / | or )?)+)", row[-1])]
    named = {w for m in after_arrows for w in re.findall(r"`([a-z_]+)`", m)} - set(INTERVENTIONS.names())
    assert len(named) > 15 and named <= signatures, named - signatures


def test_the_advice_table_is_the_detectors_own() -> None:
    table = _hook().advice_markdown()
    rows = _rows(table)
    expected = advice_table()
    assert [r[0].strip("`") for r in rows] == list(expected)
    for row in rows:
        advice = expected[row[0].strip("`")]
        assert row[2] == (", ".join(f"`{n}`" for n in advice.interventions) or "-")
        unescaped = [re.sub(r"\\(.)", r"\1", cell) for cell in row[3:]]
        assert unescaped == [advice.when, advice.text]
    kinds = {cls.kind for cls in DETECTORS.classes()}
    assert {r[1].strip("`") for r in rows} == kinds


def test_the_hook_fills_the_page_and_mkdocs_runs_it() -> None:
    hook = _hook()
    text = PAGE.read_text()
    assert text.count(hook.ADVICE_MARKER) == 1
    filled = hook.on_page_markdown(text, None, None, None)
    assert hook.ADVICE_MARKER not in filled and hook.advice_markdown() in filled
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert "docs/hooks/generated_tables.py" in config["hooks"]
