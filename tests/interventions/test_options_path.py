"""One options path: an options dataclass given directly is checked and applied like its dict."""

from __future__ import annotations

import copy

import pytest
import torch
from zoo import reference_gpt

import stabkit
from stabkit.detect_config import DetectConfig
from stabkit.detectors.spike import SpikeOptions
from stabkit.interventions import InterventionError, apply
from stabkit.interventions.qknorm import QKNormOptions
from stabkit.interventions.softcap import AttnSoftcapOptions


def _out(model: torch.nn.Module) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        return model(x)


def test_an_options_dataclass_applies_like_its_dict() -> None:
    by_dict = reference_gpt()
    by_class = copy.deepcopy(by_dict)
    h1 = apply(by_dict, [("qk_norm", {"kind": "layernorm"}), ("attn_softcap", {"cap": 7.0})])
    h2 = apply(
        by_class,
        [("qk_norm", QKNormOptions(kind="layernorm")), ("attn_softcap", AttnSoftcapOptions(cap=7.0))],
    )
    assert torch.equal(_out(by_dict), _out(by_class))
    h2.remove()
    assert not torch.equal(_out(by_dict), _out(by_class))  # the options were in effect
    h1.remove()
    h3 = apply(by_class, {"attn_softcap": AttnSoftcapOptions(cap=7.0)})
    assert h3.names == ["attn_softcap"]


def test_a_bad_value_in_a_dataclass_is_refused_by_the_same_check() -> None:
    with pytest.raises(InterventionError, match="cap must be a number in"):
        apply(reference_gpt(), [("attn_softcap", AttnSoftcapOptions(cap=-1.0))])


def test_detect_config_takes_an_options_dataclass() -> None:
    cfg = DetectConfig(options={"spike": SpikeOptions(window=48)})
    assert (
        cfg.options_for("spike").window
        == 48
        == DetectConfig(options={"spike": {"window": 48}}).options_for("spike").window
    )
    model = reference_gpt()
    with stabkit.attach(model, config=stabkit.MonitorConfig(detect=cfg)) as mon:
        assert mon.detectors is not None
