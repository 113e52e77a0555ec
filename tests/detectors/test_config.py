"""DetectConfig validation and the advice table."""

from __future__ import annotations

import pytest
from zoo import reference_gpt

import stabkit
from stabkit.detectors import DetectConfig, DetectorContext, Judge, advice_table, describe_advice
from stabkit.events import Event
from stabkit.interventions import REGISTRY


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"actions": {"nan": "warn"}}, "unknown kind"),
        ({"actions": {"spike": "explode"}}, "one of"),
        ({"actions": {"spike": []}}, "one of"),
        ({"spike_window": 0}, "spike_window must be an integer >= 1"),
        ({"spike_sigma": -1}, "spike_sigma must be a number > 0"),
        ({"spike_factor": 0.5}, "spike_factor must be None or a number > 1"),
        ({"spike_series": "loss"}, "sequence of metric-name globs"),
        ({"spike_min_ratio": {"loss": 0.5}}, "numbers >= 1"),
        ({"drift_window": 3}, "drift_window must be >= 5"),
        ({"optimizer_check_every": -1}, "optimizer_check_every must be an integer >= 0"),
        ({"loss_fn": 3}, "loss_fn must be None or a callable"),
    ],
)
def test_bad_values_are_refused_with_what_is_allowed(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DetectConfig(**kwargs)


def test_actions_are_normalised_and_decide_the_timing() -> None:
    cfg = DetectConfig(actions={"nonfinite": ["dump", "skip", "dump"]})
    assert cfg.actions == {
        "nonfinite": ("dump", "skip"),
        "spike": ("warn",),
        "drift": ("warn",),
        "amp": ("warn",),
        "attn_entropy": ("warn",),
    }
    assert cfg.needs_sync("nonfinite") and not cfg.needs_sync("spike")
    assert DetectConfig(sync=True).needs_sync("nonfinite")
    assert cfg.min_ratio("loss") == 1.5 and cfg.min_ratio("grad/blocks.3/norm") == 5.0
    assert cfg.min_ratio("update/head/ratio") == 2.0 and cfg.min_ratio("other") == 1.0


def test_advice_uses_registry_names_and_lists_every_row() -> None:
    table = advice_table()
    named = {name for row in table.values() for name in row.interventions}
    assert named == set(REGISTRY)  # every intervention is suggested somewhere, and only real ones
    text = describe_advice()
    assert all(key in text for key in table) and len(text.splitlines()) == len(table) + 1


@pytest.mark.parametrize(
    ("placement", "kind", "where", "details", "expected"),
    [
        (
            "pre",
            "drift",
            "attn/blocks.0.attn/max_logit",
            {"family": "attn_logit"},
            ("qk_norm", "attn_softcap"),
        ),
        ("pre", "drift", "logits/logz_mean", {"family": "logz"}, ("z_loss", "logit_softcap")),
        ("post", "drift", "act/blocks.1/rms", {"family": "residual"}, ("norm_placement",)),
        ("pre", "drift", "act/blocks.1/rms", {"family": "residual"}, ("norm_placement", "rmsnorm")),
        ("post", "spike", "grad/blocks.0/norm", {}, ("norm_placement",)),
        ("pre", "spike", "grad/blocks.0/norm", {}, ()),
        (
            "pre",
            "nonfinite",
            "blocks.1.attn.q_proj",
            {"pass": "forward", "module": "blocks.1.attn.q_proj"},
            ("qk_norm", "attn_softcap"),
        ),
        ("pre", "nonfinite", "head", {"pass": "forward", "module": "head"}, ("z_loss", "logit_softcap")),
        ("pre", "nonfinite", "blocks.0.mlp.fc", {"pass": "backward", "module": "blocks.0.mlp.fc"}, ()),
    ],
)
def test_advice_follows_the_signature(
    placement: str, kind: str, where: str, details: dict, expected: tuple
) -> None:
    model_map = stabkit.inspect_model(reference_gpt(norm_placement=placement, n_layers=4))
    judge = Judge(DetectorContext.from_model_map(model_map, DetectConfig()))
    event = judge.advise(Event(3, kind, where, 1.0, 0.0, "m", details=dict(details)))
    assert tuple(event.details["interventions"]) == expected
    assert event.advice and all(name in event.advice for name in expected)
