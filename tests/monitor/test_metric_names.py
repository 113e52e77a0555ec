"""Metric names built and taken apart in one place (stabkit/metric_names.py): what a probe builds, a
detector reads back — module paths with dots, model-wide and bare names included."""

from __future__ import annotations

import pytest

from stabkit.metric_names import ACT, ATTN, GRAD, MetricName, is_stat, metric, parse, path_of, stat_of


@pytest.mark.parametrize(
    ("family", "path", "stat", "name"),
    [
        (ACT, "blocks.3.mlp", "rms", "act/blocks.3.mlp/rms"),
        (
            ATTN,
            "model.model.layers.0.self_attn",
            "max_logit",
            "attn/model.model.layers.0.self_attn/max_logit",
        ),
        (ATTN, "blocks.0.attn/head.3", "max_logit", "attn/blocks.0.attn/head.3/max_logit"),
        (GRAD, "", "global_norm", "grad/global_norm"),
    ],
)
def test_a_built_name_parses_back_to_its_parts(family: str, path: str, stat: str, name: str) -> None:
    assert metric(family, path, stat) == name
    assert parse(name) == MetricName(family, path, stat) and str(parse(name)) == name
    assert path_of(name) == path and stat_of(name) == stat
    assert is_stat(name, family, stat) and not is_stat(name, "update", stat)


def test_bare_names_have_no_parts() -> None:
    assert parse("loss") is None and path_of("loss") == "" and stat_of("loss") == "loss"
    assert not is_stat("loss", ACT, "loss")


def test_the_probes_and_the_detectors_agree_on_the_names(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A monitored step's names are the ones the drift detector's rules are keyed by."""
    import torch

    import stabkit
    from stabkit.harness.models import GPT, GPTConfig

    model = GPT(GPTConfig(n_layers=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = stabkit.MonitorConfig(every=1, attn_every=1, log_every=1, console=False)
    with stabkit.attach(model, opt, logdir=tmp_path, config=config) as mon:
        x = torch.randint(0, 256, (2, 16))
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        mon.step(loss)
        logged = set(mon.history[-1][1]) if mon.history else set()
    for path in ("blocks.0.attn", "blocks.1.attn"):
        assert metric(ATTN, path, "max_logit") in logged, sorted(logged)[:10]
    for path in ("blocks.0", "blocks.1"):
        assert metric(ACT, path, "rms") in logged
        assert metric(GRAD, path, "norm") in logged
