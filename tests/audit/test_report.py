"""The Report (dict, text, Markdown) and the rule registry (spec building and the `stabkit inspect` text:
tests/cli/test_inspect_spec.py)."""

from __future__ import annotations

import importlib
import json
import re
import warnings

import pytest
import torch
from zoo import EncoderLM, NanoGPT, hf_gpt2, reference_gpt

from stabkit.audit import (
    INTERVENTIONS,
    RULES,
    Finding,
    Report,
    audit,
    describe_rules,
)
from stabkit.audit.format import compact_paths


def risky_report() -> Report:
    model = reference_gpt(norm_placement="post", bias=True, dropout=0.1, d_ff=32)
    return audit(model, torch.optim.Adam(model.parameters(), eps=1e-5, weight_decay=0.1), lr=1e-3)


def test_to_dict_is_json_and_matches_findings() -> None:
    report = risky_report()
    data = json.loads(json.dumps(report.to_dict()))
    assert [f["rule"] for f in data["findings"]] == [f.rule for f in report.findings]
    assert data["summary"] == {"risks": len(report.risks), "notes": len(report.findings) - len(report.risks)}
    assert {f.severity for f in report.risks} == {"risk"}
    assert data["memory"]["kv_cache"]["bytes_per_token"] == report.memory.kv_cache.bytes_per_token
    for f in data["findings"]:
        assert set(f) == {"rule", "severity", "where", "evidence", "why", "fix"}


def test_every_finding_cites_a_source_and_names_registry_fixes() -> None:
    reports = [risky_report(), audit(EncoderLM()), audit(hf_gpt2()), audit(NanoGPT(d=30, n_head=4))]
    assert {f.rule for r in reports for f in r.findings} == set(RULES)  # every rule is exercised here
    for f in (f for r in reports for f in r.findings):
        assert re.search(r"(19|20)\d\d|practice", f.why), f.why
        for name, _ in f.interventions:
            assert name in INTERVENTIONS
        assert f.where and all(isinstance(w, str) and w for w in f.where)


def test_intervention_names_exist_in_the_registry() -> None:
    from stabkit.interventions import ORDER

    assert set(INTERVENTIONS) <= set(ORDER)


def test_text_and_markdown_tables() -> None:
    report = risky_report()
    text = report.to_text()
    flat = " ".join(text.split())  # cells wrap across lines
    md = report.to_markdown()
    assert "| severity | rule | where | evidence | why | fix |" in md
    assert md.count("\n| **") == len(report.findings)
    for f in report.findings:
        assert f.rule in text and f.fix[0] in flat and f"`{f.rule}`" in md
    assert "blocks.{0..1}" in text and "KV cache" in text and "memory:" in text
    assert text.index("risk ") < text.rindex("note ")  # risks listed first


def test_compact_paths_and_fix_parsing() -> None:
    assert compact_paths(["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]) == "blocks.{0..2}.attn"
    assert compact_paths(["h.0.a", "h.2.a", "head"]) == "h.{0,2}.a, head"
    f = Finding(
        "x", "note", ["m"], {}, "practice", ["norm_placement(to=sandwich)", "adam eps=1e-8", "z_loss"]
    )
    assert f.interventions == [("norm_placement", {"to": "sandwich"}), ("z_loss", {})]
    with pytest.raises(ValueError, match="severity"):
        Finding("x", "bad", ["m"], {}, "practice", ["z_loss"])  # type: ignore[arg-type]


def test_registry_is_a_plain_dict_and_a_failing_rule_only_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    def custom(ctx):  # type: ignore[no-untyped-def]
        return [Finding("custom", "note", [ctx.mmap.blocks[0].path], {"n": 1}, "practice", ["z_loss"])]

    def broken(ctx):  # type: ignore[no-untyped-def]
        raise RuntimeError("boom")

    assert all(describe_rules()[name] for name in RULES)  # what `stabkit list` shows
    monkeypatch.setitem(RULES, "custom", custom)
    monkeypatch.setitem(RULES, "broken", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = audit(reference_gpt())
    assert report.by_rule("custom")[0].where == ["blocks.0"]
    assert any("'broken' failed" in str(w.message) for w in caught)
    assert report.by_rule("attn_softmax_unguarded")  # the other rules still ran
    only = audit(reference_gpt(), rules=["head_dim_small"])
    assert {f.rule for f in only.findings} == {"head_dim_small"}


def test_bad_arguments_raise_actionable_errors() -> None:
    with pytest.raises(ValueError, match="available"):
        audit(reference_gpt(), rules=["nope"])
    with pytest.raises(ValueError, match="allowed"):
        audit(reference_gpt(), active_interventions=["zloss"])
    with pytest.raises(ValueError, match="warmup_steps"):
        audit(reference_gpt(), warmup_steps=-1)


def test_top_level_audit_is_the_function() -> None:
    import stabkit

    assert isinstance(stabkit.audit(reference_gpt()), Report)
    assert importlib.import_module("stabkit.audit").RULES is RULES
