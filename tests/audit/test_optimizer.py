"""Optimizer rules: decay on embeddings/norms/biases, Adam epsilon, coupled weight decay."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zoo import reference_gpt

from stabkit.audit import Report, audit

OPT_RULES = ("weight_decay_targets", "adam_eps", "coupled_weight_decay")


def by_kind(report: Report) -> dict[str, list[str]]:
    return {f.evidence["decayed"]: f.where for f in report.by_rule("weight_decay_targets")}


def split_groups(model: nn.Module, wd: float = 0.1) -> list[dict]:
    """The usual recipe: decay matrices only, not embeddings, norms or biases."""
    decay, rest = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and "emb" not in name else rest).append(p)
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def test_decay_on_embeddings_norms_and_biases_names_each_parameter() -> None:
    model = reference_gpt(bias=True)
    report = audit(model, torch.optim.AdamW(model.parameters(), weight_decay=0.1))
    kinds = by_kind(report)
    modules = dict(model.named_modules())
    owner = {n: modules[n.rsplit(".", 1)[0]] for n, _ in model.named_parameters()}
    assert kinds["embeddings"] == ["tok_emb.weight", "pos_emb.weight"]
    assert kinds["norms"] == [n for n, m in owner.items() if isinstance(m, nn.LayerNorm)]
    assert kinds["biases"] == [n for n, m in owner.items() if isinstance(m, nn.Linear) and n.endswith("bias")]
    severities = {f.evidence["decayed"]: f.severity for f in report.by_rule("weight_decay_targets")}
    assert severities == {"embeddings": "risk", "norms": "note", "biases": "note"}
    assert audit(model, torch.optim.AdamW(split_groups(model))).by_rule("weight_decay_targets") == []


def test_tied_head_counts_as_embedding() -> None:
    model = reference_gpt(tie_embeddings=True)
    groups = [{"params": [model.get_submodule("head").weight], "weight_decay": 0.1}]
    assert by_kind(audit(model, torch.optim.AdamW(groups))) == {"embeddings": ["tok_emb.weight"]}


def test_adam_eps() -> None:
    model = reference_gpt()
    f = audit(model, torch.optim.Adam(model.parameters(), eps=1e-6)).by_rule("adam_eps")
    assert [x.where for x in f] == [["optimizer.param_groups[0]"]] and f[0].severity == "risk"
    assert f[0].fix == ["adam eps=1e-8"]
    params = list(model.parameters())
    two = torch.optim.AdamW([{"params": params[:3]}, {"params": params[3:], "eps": 1e-5}], eps=1e-8)
    assert [x.where for x in audit(model, two).by_rule("adam_eps")] == [["optimizer.param_groups[1]"]]
    assert audit(model, torch.optim.AdamW(model.parameters(), eps=1e-8)).by_rule("adam_eps") == []
    assert audit(model, torch.optim.SGD(model.parameters(), lr=0.1)).by_rule("adam_eps") == []


def test_coupled_weight_decay_reports_effective_decay_at_the_given_lr() -> None:
    model = reference_gpt()
    opt = torch.optim.AdamW(split_groups(model, wd=0.1), lr=1e-3)
    (f,) = audit(model, opt, lr=3e-3).by_rule("coupled_weight_decay")
    assert f.where == ["optimizer.param_groups[0]"] and f.evidence["mode"] == "coupled"
    assert f.evidence["effective_decay_per_step"] == pytest.approx(3e-3 * 0.1)
    (g,) = audit(model, opt).by_rule("coupled_weight_decay")  # no lr given: the group's lr
    assert g.evidence["effective_decay_per_step"] == pytest.approx(1e-3 * 0.1)
    flagged = audit(
        model, torch.optim.Adam(model.parameters(), weight_decay=0.1, decoupled_weight_decay=True)
    )
    assert flagged.by_rule("coupled_weight_decay")[0].evidence["mode"] == "coupled"
    l2 = audit(model, torch.optim.Adam(model.parameters(), weight_decay=0.1)).by_rule("coupled_weight_decay")
    assert l2[0].evidence["mode"] == "l2"
    assert (
        audit(model, torch.optim.AdamW(model.parameters(), weight_decay=0.0)).by_rule("coupled_weight_decay")
        == []
    )
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1)
    assert audit(model, sgd).by_rule("coupled_weight_decay") == []


def test_optimizer_rules_silent_without_optimizer() -> None:
    report = audit(reference_gpt(bias=True))
    assert not [f for f in report.findings if f.rule in OPT_RULES]
