"""DetectConfig validation (names, each plug-in's options through its options dataclass, the flat
settings of earlier versions) and the advice table."""

from __future__ import annotations

import dataclasses

import pytest
from zoo import reference_gpt

import stabkit
from stabkit.detectors import (
    DetectConfig,
    DetectorContext,
    Judge,
    SpikeOptions,
    advice_table,
    describe_advice,
)
from stabkit.events import Event
from stabkit.interventions import ORDER
from stabkit.plugins import ACTIONS, DETECTORS
from stabkit.tables import RANGE


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"actions": {"nan": "warn"}}, "unknown kind"),
        ({"actions": {"spike": "explode"}}, "one of"),
        ({"actions": {"spike": []}}, "one of"),
        ({"options": {"nope": {}}}, r"unknown detector\(s\) or action\(s\) \['nope'\]"),
        ({"options": {"spike": {"window": 0}}}, "options.spike.window: must be an integer >= 1, got 0"),
        ({"options": {"spike": {"sigma": -1}}}, r"options.spike.sigma: must be a number in \(0, inf\)"),
        ({"options": {"spike": {"factor": 0.5}}}, r"options.spike.factor: must be a number in \(1, inf\)"),
        ({"options": {"spike": {"series": "loss"}}}, "options.spike.series: must be an array"),
        (
            {"options": {"spike": {"min_ratio": {"loss": 0.5}}}},
            r"options.spike.min_ratio.loss: .* \[1, inf\)",
        ),
        ({"options": {"spike": {"windw": 9}}}, "options.spike.windw: unknown key; allowed: series, window"),
        (
            {"options": {"drift": {"window": 3}}},
            "options.drift.window: must be an integer >= 5, got 3; a slope",
        ),
        (
            {"options": {"nonfinite": {"optimizer_check_every": -1}}},
            "optimizer_check_every: must be an integer >= 0",
        ),
        ({"options": {"nonfinite": {"loss_fn": 3}}}, "options.nonfinite.loss_fn: must be a callable"),
        ({"options": {"rollback": {"snapshots": 0}}}, "options.rollback.snapshots: must be an integer >= 1"),
    ],
)
def test_bad_values_are_refused_naming_the_plugin_and_field(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DetectConfig(**kwargs)


def test_every_range_is_the_bounds_metadata_of_an_options_dataclass() -> None:
    """The one range check: each built-in plug-in that takes settings declares an options dataclass
    whose ranged fields carry `bounds`; DetectConfig itself holds only what is no plug-in's."""
    assert [f.name for f in dataclasses.fields(DetectConfig) if f.init] == [
        "actions",
        "detectors",
        "options",
        "sync",
        "act_on",
    ]
    classes = [DETECTORS.load(k) for k in DETECTORS.names()] + [ACTIONS.load(a) for a in ACTIONS.names()]
    declared = {c.__name__: c.options_class for c in classes if getattr(c, "options_class", None) is not None}
    assert set(declared) >= {"SpikeDetector", "DriftDetector", "EntropyCollapseDetector", "NonfiniteDetector"}
    assert {"Rollback", "Dump"} <= set(declared)
    for options in declared.values():
        ranged = [f for f in dataclasses.fields(options) if RANGE in f.metadata]
        assert ranged or options.__name__ == "DumpOptions", options
        assert "__post_init__" not in vars(options) or options.__name__ in (
            "EntropyOptions",  # low < healthy: a relation, not a range
            "SnapshotOptions",  # the snapshot device
            "RescueOptions",  # each fix can go on mid-run (the interventions registry)
            "ClipOptions",  # min_history <= window: a relation, not a range
        )


def test_actions_are_normalised_and_decide_the_timing() -> None:
    cfg = DetectConfig(actions={"nonfinite": ["dump", "skip", "dump"]})
    assert cfg.actions == {
        kind: ("dump", "skip") if kind == "nonfinite" else ("warn",) for kind in DETECTORS.names()
    }
    assert cfg.needs_sync("nonfinite") and not cfg.needs_sync("spike")
    assert DetectConfig(sync=True).needs_sync("nonfinite")
    spike = cfg.options_for("spike")
    assert isinstance(spike, SpikeOptions)
    assert spike.min_ratio_of("loss") == 1.5 and spike.min_ratio_of("grad/blocks.3/norm") == 5.0
    assert spike.min_ratio_of("update/head/ratio") == 2.0 and spike.min_ratio_of("other") == 1.0


def test_options_are_checked_converted_and_cached() -> None:
    cfg = DetectConfig(options={"spike": {"window": 64, "sigma": 5, "series": ["loss"]}})
    spike = cfg.options_for("spike")
    assert (spike.window, spike.sigma, spike.series) == (64, 5.0, ("loss",)) and isinstance(
        spike.sigma, float
    )
    assert cfg.options_for("spike") is spike and cfg.options_for("spike", SpikeOptions) is spike
    assert cfg == DetectConfig(options={"spike": {"window": 64, "sigma": 5, "series": ["loss"]}})
    assert cfg.options_for("drift").window == 20  # not named: the defaults


def test_advice_uses_registry_names_and_lists_every_row() -> None:
    table = advice_table()
    named = {name for row in table.values() for name in row.interventions}
    assert named == set(ORDER)  # every intervention is suggested somewhere, and only real ones
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
            ("qk_clip", "qk_norm", "attn_softcap"),
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
            ("qk_norm", "attn_softcap", "qk_clip"),
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
