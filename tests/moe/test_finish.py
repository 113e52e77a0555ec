"""The load ratios taken on the host from summed counts (`stabkit.moe.finish`), the dead-expert window,
and the per-expert load written to TensorBoard as one histogram per layer."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import stabkit
from stabkit.moe.finish import LoadFinisher, load_name, load_ratios

from .tiny import build, tokens


def test_ratios_of_planted_loads() -> None:
    assert load_ratios([2.0, 2.0, 2.0, 2.0]) == {"max_vio": 0.0, "cv": 0.0, "busiest_share": 0.25}
    collapsed = load_ratios([0.0, 0.0, 8.0, 8.0])  # top-2 of 4, every token on experts 2 and 3
    assert collapsed["max_vio"] == pytest.approx(1.0)  # E / k - 1
    assert collapsed["busiest_share"] == 0.5 and collapsed["cv"] == pytest.approx(1.0)
    assert load_ratios([0.0, 0.0]) == {}


def test_counts_summed_over_ranks_give_the_ratio_of_the_sum() -> None:
    rank0, rank1 = [6.0, 0.0, 1.0, 1.0], [0.0, 6.0, 1.0, 1.0]
    summed = [a + b for a, b in zip(rank0, rank1, strict=True)]  # what the 'sum' reduction hands back
    rows = [(0, {load_name("l", e): x for e, x in enumerate(summed)})]
    LoadFinisher(window=10).finish(rows)
    assert rows[0][1]["moe/l/max_vio"] == pytest.approx(0.5)  # each rank alone: 2.0
    assert rows[0][1]["moe/l/max_vio"] != pytest.approx(load_ratios(rank0)["max_vio"])


def test_dead_experts_over_a_window() -> None:
    finisher = LoadFinisher(window=3, start=10)
    loads = {10: [1, 1, 0], 11: [1, 0, 0], 12: [1, 0, 0], 13: [1, 0, 0], 14: [1, 0, 1]}
    rows = [(s, {load_name("l", e): float(x) for e, x in enumerate(v)}) for s, v in loads.items()]
    finisher.finish(rows[:2])
    finisher.finish(rows[2:])  # the window spans log intervals
    dead = [row.get("moe/l/dead_experts") for _, row in rows]
    # written from step 12 (3 steps since attach): expert 2 (no token yet) is dead at 12 and 13, expert 1
    # (last token at step 10) from step 13; expert 2 comes back at step 14
    assert dead == [None, None, 1.0, 2.0, 1.0]
    assert finisher.last_seen["moe/l"] == [14, 10, 14]


def test_load_is_a_histogram_per_layer_in_tensorboard(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model = build("mixtral")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    cfg = stabkit.MonitorConfig(every=1, log_every=1, console=False, audit=False, detect=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon = stabkit.attach(model, opt, logdir=tmp_path, config=cfg)
    x = tokens()
    loss = model(x, labels=x).loss
    loss.backward()
    opt.step()
    mon.step(loss)
    mon.detach()
    row = mon.history[0][1]
    acc = EventAccumulator(str(mon.logdir), size_guidance={"histograms": 0}).Reload()
    tag = "moe/model.layers.0.mlp/load"
    assert tag in acc.Tags()["histograms"]
    assert not any("[" in t for t in acc.Tags()["scalars"])  # not 4 scalars per layer
    hist = acc.Histograms(tag)[0].histogram_value
    assert list(hist.bucket) == [row[f"{tag}[{e}]"] for e in range(4)]
    assert hist.num == 2 * x.numel()  # k = 2 choices per token
