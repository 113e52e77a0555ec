"""stabkit.distributed pieces that need no process group: the per-entry combination, rank-0-only
sinks, ratio finishing, batch sharding, the torchrun command line, and single-process identity."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import stabkit
from stabkit.distributed import (
    SINGLE,
    DistContext,
    RankEventEcho,
    agree,
    combine,
    detect,
    finish_ratios,
    host_values,
    rank_sinks,
    reduce_now,
    reduce_stacked,
    shard_rows,
    torchrun_command,
    unwrap_data_parallel,
)
from stabkit.events import Event
from stabkit.integrations import inner_optimizer


def test_combine_each_column_by_its_reduction() -> None:
    table = torch.tensor(
        [
            [1.0, 1.0, 3.0, 5.0, 3.0, 1.0, 0.0, -1.0],
            [2.0, 3.0, 2.0, 6.0, 4.0, 7.0, math.nan, math.inf],
        ]
    )
    got = combine(table, ["mean", "sum", "max", "min", "l2", "rms", "max", "min"]).tolist()
    want = [1.5, 4.0, 3.0, 5.0, 5.0, 5.0, math.nan, -1.0]  # l2 √(9+16), rms √((1+49)/2)
    assert math.isnan(got[6])
    assert [g for i, g in enumerate(got) if i != 6] == pytest.approx(
        [w for i, w in enumerate(want) if i != 6]
    )


def test_unknown_reduction_names_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="allowed:.*l2"):
        combine(torch.ones(2, 1), ["median"])


def test_single_process_is_identity() -> None:
    values = torch.tensor([1.0, math.nan, 3.0])
    assert reduce_now(values, ["mean", "max", "l2"]) is values
    flag = torch.tensor(True)
    assert agree(flag) is flag
    assert detect(nn.Linear(2, 2)) is SINGLE and SINGLE.mode == "single" and SINGLE.writes
    got = host_values([torch.tensor(2.0), torch.tensor([True])], ["l2", "max"])
    assert got == [2.0, 1.0] and host_values([], []) == []
    with pytest.raises(ValueError, match="3 values but 2 reductions"):
        reduce_stacked(values, ["mean", "max"])


def test_norm_scales_count_a_replicated_tensor_once() -> None:
    params = [torch.zeros(3), torch.zeros(2)]
    scales = DistContext(True, 0, 4).norm_scales(params)
    assert scales == [0.5, 0.5]  # 4 ranks × (n/2)² = n²
    assert SINGLE.norm_scales(params) == [1.0, 1.0]


def test_only_rank_zero_writes_files(tmp_path: Path) -> None:
    config = stabkit.MonitorConfig(console=True)
    other = rank_sinks(tmp_path / "r1", config, DistContext(True, 1, 2))
    other.write_rows([(0, {"loss": 1.0})])
    other.write_text("t", "x")
    other.close()
    assert not (tmp_path / "r1").exists()
    writer = rank_sinks(tmp_path / "r0", config, DistContext(True, 0, 2))
    writer.write_rows([(0, {"loss": 1.0})])
    writer.close()
    assert (tmp_path / "r0" / "stabkit.jsonl").exists()
    assert list((tmp_path / "r0").glob("events.out.tfevents.*"))


def test_other_ranks_echo_only_their_nonfinite_events() -> None:
    stream = io.StringIO()
    echo = RankEventEcho(3, stream)
    echo.write_event(Event(5, "spike", "loss", 9.0, 3.0, "loss spiked"))  # the same on every rank
    echo.write_event(Event(5, "nonfinite", "blocks.1.mlp", math.nan, 0.0, "produced NaN"))
    echo.write_metrics(5, {"loss": 1.0})
    assert stream.getvalue().splitlines() == [
        "[stabkit rank 3] [nonfinite] step 5 at blocks.1.mlp: produced NaN"
    ]


def test_finish_ratios_divides_reduced_parts() -> None:
    rows = [
        (0, {"update/blocks.0/ratio.num": 0.2, "update/blocks.0/ratio.den": 4.0, "loss": 1.0}),
        (1, {"update/global_ratio.num": 1.0, "update/global_ratio.den": 0.0}),
    ]
    finish_ratios(rows)
    assert rows[0][1] == {"update/blocks.0/ratio": pytest.approx(0.05), "loss": 1.0}
    assert rows[1][1] == {"update/global_ratio": pytest.approx(1e12)}


def test_shard_rows_and_torchrun_command() -> None:
    assert shard_rows(8, DistContext(True, 1, 4)) == slice(2, 4)
    assert shard_rows(8, SINGLE) == slice(0, 8)
    with pytest.raises(ValueError, match="divisible"):
        shard_rows(6, DistContext(True, 0, 4))
    cmd = torchrun_command(2, ["run", "recipes/x.toml"])
    assert cmd[1:] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "stabkit",
        "run",
        "recipes/x.toml",
    ]


def test_wrappers_are_unwrapped() -> None:
    inner = nn.Linear(2, 2)
    assert unwrap_data_parallel(nn.DataParallel(inner)) is inner
    opt = torch.optim.SGD(inner.parameters(), lr=0.1)

    class Wrapped(torch.optim.Optimizer):  # like accelerate's AcceleratedOptimizer
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

    assert inner_optimizer(Wrapped(opt)) is opt
    assert inner_optimizer(opt) is opt and inner_optimizer(None) is None


def test_attach_before_init_process_group_warns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.warns(RuntimeWarning, match="init_process_group"):
        assert detect(nn.Linear(2, 2)) is SINGLE
