"""The MoE detectors on rows built from hand counts (no model): expert collapse is found at the step
its hold completes and names the layer, with a threshold relative to the most MaxVio can be for top-k
of E; an early transient stays silent; a dead expert is found at the step the MoE probe's own
dead-expert count rises; router log Z drift is found where it crosses its level, graded by the loss."""

from __future__ import annotations

import numpy as np
import pytest

from stabkit.detectors import DetectConfig, DetectorContext, Judge, MoELayerInfo
from stabkit.events import Event
from stabkit.moe.finish import LoadFinisher, load_name

LAYERS = (MoELayerInfo("model.layers.0.mlp", 8, 2), MoELayerInfo("model.layers.1.mlp", 8, 2))


def judge(layers: tuple[MoELayerInfo, ...] = LAYERS, **options: dict) -> Judge:
    return Judge(DetectorContext(DetectConfig(options=options), moe_layers=layers))


def events(rows: list[tuple[int, dict[str, float]]], kind: str, j: Judge | None = None) -> list[Event]:
    return [e for e in (j or judge()).rows(rows) if e.kind == kind]


def balanced(rng: np.random.Generator, n: int = 8, k: int = 2, tokens: int = 512) -> list[float]:
    """Counts of `tokens` tokens × k distinct experts drawn uniformly (a balanced router)."""
    load = np.zeros(n)
    for _ in range(tokens):
        load[rng.choice(n, size=k, replace=False)] += 1
    return load.tolist()


def collapsed(n: int = 8, k: int = 2, tokens: int = 512, onto: int = 3) -> list[float]:
    """Every token's first choice on expert `onto`, its second spread evenly over the others."""
    load = [tokens * (k - 1) / (n - 1)] * n
    load[onto] = float(tokens)
    return load


def load_row(layer: str, load: list[float], **extra: float) -> dict[str, float]:
    return {**{load_name(layer, e): x for e, x in enumerate(load)}, **extra}


def collapse_rows(
    collapse_from: int | None, until: int | None = None, steps: int = 600, layer: int = 1
) -> list:
    """Sampled every 10 steps; layer `layer` collapsed on expert 3 from step `collapse_from` to `until`."""
    rng = np.random.default_rng(0)
    rows = []
    for step in range(0, steps, 10):
        row: dict[str, float] = {"loss": 3.0 - step / 1000}
        for i, info in enumerate(LAYERS):
            bad = i == layer and collapse_from is not None and collapse_from <= step < (until or steps)
            row.update(load_row(info.path, collapsed() if bad else balanced(rng)))
        rows.append((step, row))
    return rows


def test_a_collapse_is_found_when_its_hold_completes_and_names_the_layer() -> None:
    found = events(collapse_rows(300), "expert_collapse")
    # by hand: the 200-step span ending at step s holds the 21 values s-200..s; 80 % of 21 is 16.8,
    # so the 17th collapsed value (steps 300..460) completes the hold.
    assert [(e.step, e.where) for e in found] == [(460, "model.layers.1.mlp")]
    e = found[0]
    assert e.severity == "warning" and e.details["since"] == 300 and e.details["busiest_expert"] == 3
    # collapsed(): expert 3 has 512 of 1024 choices, the share's maximum 1/k: MaxVio = 8·0.5 − 1 = 3
    assert e.value == pytest.approx(3.0) and e.details["max_vio_max"] == pytest.approx(3.0)
    assert e.threshold == pytest.approx(0.75 * 3.0) and e.details["collapse"] == pytest.approx(1.0)
    assert (
        "load_balance_loss" in e.details["interventions"] and "aux_free_balance" in e.details["interventions"]
    )
    assert "1e-2" in e.advice and "0.001" in e.advice and "capacity factor" in e.advice


def test_a_balanced_run_and_an_early_transient_stay_silent() -> None:
    assert events(collapse_rows(None), "expert_collapse") == []
    # collapsed for 50 or 130 steps, as healthy runs with a balancing loss pass through early
    assert events(collapse_rows(10, until=60), "expert_collapse") == []
    assert events(collapse_rows(20, until=150), "expert_collapse") == []


def test_a_collapse_that_ends_rearms_the_layer() -> None:
    rows = collapse_rows(100, until=300, steps=800)
    rows2 = collapse_rows(400, steps=800)
    merged = [(s, r if s < 350 else r2) for (s, r), (_, r2) in zip(rows, rows2, strict=True)]
    # re-armed at step 320 (3 balanced values in a row), collapsed again 400..560
    assert [e.step for e in events(merged, "expert_collapse")] == [260, 560]


def test_the_threshold_is_relative_to_the_most_maxvio_can_be() -> None:
    # MaxVio 2.5 on 8 experts: 5/6 of the maximum under top-2 (3), 5/14 under top-1 (7)
    load = [2.5 * 128 + 128] + [(1024 - 448) / 7] * 7  # max = (1 + 2.5)·mean, mean 128
    assert (max(load) - 128) / 128 == pytest.approx(2.5) and sum(load) == pytest.approx(1024)
    rows = [(s, load_row("m", load)) for s in range(0, 300, 10)]
    top2 = events(rows, "expert_collapse", judge((MoELayerInfo("m", 8, 2),)))
    top1 = events(rows, "expert_collapse", judge((MoELayerInfo("m", 8, 1),)))
    assert [e.step for e in top2] == [200] and top1 == []
    assert events(rows, "expert_collapse", judge(())) == []  # k unknown: not judged


def test_options_move_the_threshold_and_the_hold() -> None:
    rows = collapse_rows(300)
    assert [e.step for e in events(rows, "expert_collapse", judge(expert_collapse={"hold_steps": 50}))] == [
        340
    ]
    assert [e.step for e in events(rows, "expert_collapse", judge(expert_collapse={"held": 1.0}))] == [500]
    with pytest.raises(ValueError, match="expert_collapse.level"):
        DetectConfig(options={"expert_collapse": {"level": 1.5}})


def dead_rows(
    dead_from: int,
    revive: tuple[int, int] | None = None,
    every: int = 10,
    steps: int = 500,
    killed: tuple[int, ...] = (2,),
) -> list:
    """Top-2 of 8, 128 tokens a sampled step; experts `killed` get none from step `dead_from`."""
    rng = np.random.default_rng(1)
    rows = []
    for step in range(0, steps, every):
        load = balanced(rng, n=8, k=2, tokens=128)
        alive = revive is not None and revive[0] <= step < revive[1]
        for e in killed if step >= dead_from and not alive else ():
            load[e] = 0.0
        rows.append((step, load_row("model.layers.0.mlp", load)))
    return rows


def test_a_dead_expert_is_found_when_the_probe_counts_it_dead() -> None:
    rows = dead_rows(200)
    found = events([(s, dict(r)) for s, r in rows], "dead_experts")
    assert [(e.step, e.where, e.details["experts"]) for e in found] == [(290, "model.layers.0.mlp", [2])]
    # one of 8 experts, dead 100 steps: a note (a rarely chosen expert of a small run comes back)
    assert found[0].details["since"] == 190 and found[0].severity == "info"
    # the MoE probe's own count, over the same rows
    LoadFinisher(100).finish(rows)
    counted = [s for s, r in rows if r.get("moe/model.layers.0.mlp/dead_experts", 0) > 0]
    assert counted[0] == found[0].step
    assert "aux_free_balance" in found[0].details["interventions"]


def test_a_dead_expert_held_or_a_quarter_of_the_layer_dead_is_a_warning() -> None:
    held = events(dead_rows(200, steps=900), "dead_experts")
    # by hand: last token at step 190; dead at 290 (note), still dead 500 steps after it at 690 (warning)
    assert [(e.step, e.severity, e.details["experts"]) for e in held] == [
        (290, "info", [2]),
        (690, "warning", [2]),
    ]
    two = events(dead_rows(200, killed=(2, 5)), "dead_experts")  # 2 of 8 = the warn share
    assert [(e.step, e.severity, e.details["experts"]) for e in two] == [(290, "warning", [2, 5])]
    short = events(dead_rows(200, steps=900), "dead_experts", judge(dead_experts={"warn_steps": 200}))
    assert [(e.step, e.severity) for e in short] == [(290, "info"), (390, "warning")]


def test_a_revived_expert_that_dies_again_is_reported_again() -> None:
    found = events(dead_rows(100, revive=(250, 260)), "dead_experts")
    assert [(e.step, e.details["experts"]) for e in found] == [(190, [2]), (350, [2])]


def test_sampled_rarely_a_dead_expert_needs_several_empty_samples() -> None:
    # sampled every 100 steps: dead after 100 steps, but only once 5 samples saw it empty
    found = events(dead_rows(200, every=100, steps=1000), "dead_experts")
    assert [e.step for e in found] == [600]


def z_rows(rise_from: int | None, rate: float = 0.02, loss_falls: bool = True, steps: int = 600) -> list:
    """Router log Z around log 8 with noise σ 0.01, rising `rate` nats per step from `rise_from`."""
    rng = np.random.default_rng(2)
    rows = []
    for step in range(0, steps, 10):
        z = 2.08 + 0.01 * rng.standard_normal()
        if rise_from is not None and step >= rise_from:
            z += rate * (step - rise_from)
        rows.append(
            (
                step,
                {
                    "moe/model.layers.1.mlp/logz_mean": z,
                    "moe/model.layers.1.mlp/logit_max": z + 1,
                    "moe/model.layers.0.mlp/logz_mean": 2.08 + 0.01 * rng.standard_normal(),
                    "loss": (3.0 - step / 1000) if loss_falls else 2.5 + step / 10000,
                },
            )
        )
    return rows


def test_router_z_drift_is_found_past_its_level_and_names_the_layer() -> None:
    found = events(z_rows(200), "router_z")
    assert found and {e.where for e in found} == {"model.layers.1.mlp"}
    e = found[0]
    # a note, then a warning once held 6 nats above the start: step 500 (σ 0.01 of noise puts it on
    # the line, so 510), held 3 values
    assert [e.severity for e in found] == ["info", "warning"] and found[1].step in (520, 530)
    # by hand: 0.02 nats a step from step 200 is 3 nats above the start at step 350
    assert e.step == 370 and e.details["since"] == 270  # 3 nats at step 350, held 3 values; 1.5 at 275
    assert e.severity == "info" and e.details["loss_falling"]  # growing while the loss falls: a note
    assert e.details["interventions"] == ["router_z_loss", "router_fp32"] and "1e-3" in e.advice


def test_router_z_is_a_warning_when_the_loss_stalls_or_past_the_danger_line() -> None:
    stalled = events(z_rows(200, loss_falls=False), "router_z")
    assert stalled and stalled[0].severity == "warning" and "stopped falling" in stalled[0].message
    fast = events(z_rows(200, rate=0.05), "router_z")
    assert any(e.severity == "warning" and "danger" in e.message for e in fast)


def test_a_healthy_router_sharpening_stays_silent() -> None:
    # healthy tiny routers: +0.1..0.75 nats over 300 steps
    assert events(z_rows(0, rate=0.0025), "router_z") == []
    assert events(z_rows(None), "router_z") == []


def test_state_round_trips() -> None:
    rows = collapse_rows(300) + [(s + 600, r) for s, r in dead_rows(0)]
    first, second = judge(), judge()
    first.rows(rows[:33])
    second.load_state_dict(first.state_dict())
    later = [(e.kind, e.step) for e in first.rows(rows[33:])]
    # layer 0's expert 2 was last fed at step 590 (the collapse rows): dead at 690, held at 1090
    assert later[:3] == [("expert_collapse", 460), ("dead_experts", 690), ("dead_experts", 1090)]
    assert later == [(e.kind, e.step) for e in second.rows(rows[33:])]
