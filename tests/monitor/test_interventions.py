"""attach(..., interventions=[...]) switches fixes on, logs them, and switches them off on detach."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from zoo import batch, lm_loss, reference_gpt

import stabkit
from stabkit.sinks import LOG_NAME, read_jsonl


def test_attach_applies_logs_and_removes_interventions(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    x, y = batch(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    groups = len(opt.param_groups)
    mon = stabkit.attach(
        model,
        opt,
        logdir=tmp_path,
        config=stabkit.MonitorConfig(every=1, console=False),
        interventions=["qk_norm", ("z_loss", {"coef": 1e-3})],
    )
    assert mon.interventions is not None and set(mon.interventions.names) == {"qk_norm", "z_loss"}
    new = mon.interventions.new_parameters()
    assert new and len(opt.param_groups) == groups + 1
    assert opt.param_groups[-1]["weight_decay"] == 0.0 and opt.param_groups[-1]["params"] == new
    logits = model(x)
    loss = lm_loss(logits, y)
    loss.backward()
    opt.step()
    mon.step(loss)
    mon.flush()
    logz = torch.logsumexp(logits.detach().float(), dim=-1)
    assert mon.metrics["logits/z_loss"] == pytest.approx((1e-3 * logz.pow(2).mean()).item(), rel=1e-4)
    mon.detach()
    assert mon.interventions.removed
    texts = [
        r
        for r in read_jsonl(tmp_path / LOG_NAME)
        if r["type"] == "text" and r["tag"] == "stabkit/interventions"
    ]
    assert texts and "qk_norm" in texts[0]["text"]
    assert set(model.state_dict()) == set(reference_gpt().state_dict()), "no intervention state left behind"
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_a_bad_intervention_leaves_the_model_untouched() -> None:
    model = reference_gpt()
    hooks = [dict(m._forward_hooks) for m in model.modules()]
    with pytest.raises(ValueError, match="qk_nrom"):
        stabkit.attach(model, interventions=["qk_nrom"])
    assert [dict(m._forward_hooks) for m in model.modules()] == hooks
