"""Smoke test of the model zoo: every entry builds, trains one step and makes the attention calls it claims."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from zoo_models import ZOO, ZooModel, attention_logit_maxima
from zoo_models.reference import AttentionLogitRecorder

torch.set_num_threads(1)

pytestmark = pytest.mark.zoo


def build(name: str) -> ZooModel:
    try:
        return ZOO[name]()
    except ImportError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_model(name: str) -> None:
    zoo = build(name)
    model = zoo.model
    assert model.training
    params = list(model.parameters())
    assert params and all(p.dtype == torch.float32 and p.device.type == "cpu" for p in params)
    assert not any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())

    out = zoo.forward()
    loss = zoo.loss_fn(out)
    assert loss.dim() == 0 and math.isfinite(loss.item())
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in params)

    if zoo.logits_fn is not None:
        logits = zoo.logits_fn(out)
        assert zoo.n_classes is not None and logits.shape[-1] == zoo.n_classes
        assert logits.shape[0] == 2

    with torch.no_grad():
        maxima = attention_logit_maxima(model, zoo.args, zoo.inputs)
        again = zoo.loss_fn(zoo.forward())
        with AttentionLogitRecorder() as recorder:
            recorded = zoo.loss_fn(zoo.forward())
    assert len(maxima) == zoo.n_attention_calls, maxima
    assert all(math.isfinite(m) for m in maxima)
    assert recorder.maxima == maxima
    # dropout is off (the forward is deterministic) and the recording mode passes every call through
    assert again.item() == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
    assert recorded.item() == pytest.approx(again.item(), rel=1e-6, abs=1e-7)
