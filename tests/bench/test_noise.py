"""The bench's noise band: the standard error over blocks of whole monitor cycles when the rounds hold
enough of them, else the rounds' half spread. Checked on made-up step times against hand computations
(no timing is asserted)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stabkit import MonitorConfig
from stabkit.bench import format_table
from stabkit.bench.fixed_cost import added_ms
from stabkit.bench.noise import MIN_BLOCK_STEPS, band, block_ratios, cycle
from stabkit.bench.runner import BenchResult, VariantResult


def _rounds(steps: int, rounds: int, sampled_every: int = 10, base: float = 0.050) -> tuple[list, list]:
    """Bare at `base` s a step; the monitored variant +10 ms on each `sampled_every`-th step, +0.5 ms
    on the others: its cost varies by which steps a block holds, not by noise."""
    bare = [[base] * steps for _ in range(rounds)]
    mine = [
        [base + (0.010 if i % sampled_every == 0 else 0.0005) for i in range(steps)] for _ in range(rounds)
    ]
    return bare, mine


def _result(bare: list, mine: list, cycle_steps: int) -> BenchResult:
    n = len(bare)
    cpu = lambda rounds: [sum(r) / len(r) for r in rounds]  # noqa: E731
    variants = {
        "bare": VariantResult("bare", step_times=cpu(bare), cpu_times=cpu(bare), step_cpu=bare),
        "default": VariantResult(
            "default",
            step_times=cpu(mine),
            cpu_times=cpu(mine),
            monitored=True,
            step_cpu=mine,
            step_sampled=[[False] * len(r) for r in mine],
            cycle=cycle_steps,
        ),
    }
    cfg = {"device": "cpu", "size": "small-step", "steps": len(bare[0]), "repeats": n, "bf16": False}
    return BenchResult(config=cfg, variants=variants, model_bytes=1)


def test_block_ratios_are_each_blocks_time_over_bares_for_the_same_steps() -> None:
    bare = [[1.0, 1.0, 2.0, 2.0, 5.0], [1.0, 3.0, 1.0, 1.0]]
    mine = [[1.5, 1.5, 2.0, 3.0, 9.0], [2.0, 2.0, 1.0, 2.0]]
    # round 1: (1.5+1.5)/(1+1), (2+3)/(2+2), the fifth step short of a block; round 2: 4/4, 3/2
    assert block_ratios(mine, bare, 2) == pytest.approx([1.5, 1.25, 1.0, 1.5])


def test_blocks_of_whole_cycles_read_no_noise_where_the_cost_only_follows_the_cycle() -> None:
    bare, mine = _rounds(steps=300, rounds=2)
    found = band([1.0, 1.0], mine, bare, steps_per_cycle=50)
    assert found is not None and found.blocks == 12 and found.block_steps == 50
    assert found.value == pytest.approx(0.0, abs=1e-12)
    # blocks cut across the cycle would read the sampled steps' share as noise
    assert np.std(block_ratios(mine, bare, 7)) > 1e-3


def test_the_band_is_the_standard_error_of_the_blocks_mean() -> None:
    bare, mine = _rounds(steps=300, rounds=2)
    slow = [1.0, 1.0, 1.0, 1.04, 1.0, 1.0, 1.02, 1.0, 1.0, 1.0, 1.0, 0.97]  # a machine's spells, per block
    for k, factor in enumerate(slow):
        r, start = divmod(k, 6)
        for i in range(start * 50, start * 50 + 50):
            mine[r][i] *= factor
    ratios = np.array(block_ratios(mine, bare, 50))
    expected = ratios.std(ddof=1) / math.sqrt(len(ratios))
    found = band([1.0, 1.0], mine, bare, steps_per_cycle=50)
    assert found is not None and found.value == pytest.approx(expected, rel=1e-9)
    result = _result(bare, mine, 50)
    assert result.noise("default") == pytest.approx(expected, rel=1e-9)
    row = result.to_dict()["variants"]["default"]
    assert row["ratio_noise"] == pytest.approx(expected, rel=1e-9)
    assert row["ratio_noise_basis"] == "standard error over 12 blocks of 50 steps"
    table = format_table(result)
    assert f"±{expected:.3f}" in table
    assert "standard error over 12 blocks of 50 steps (a block: whole cycles" in table


def test_rounds_too_short_for_enough_cycles_fall_back_to_their_half_spread() -> None:
    bare, mine = _rounds(steps=40, rounds=5)
    found = band([1.02, 1.05, 1.01, 1.03, 1.04], mine, bare, steps_per_cycle=50)
    assert found is not None and found.blocks == 0 and found.value == pytest.approx(0.02)
    assert found.basis() == "half the spread of 5 rounds"
    assert band([1.02], mine[:1], bare[:1], steps_per_cycle=50) is None
    table = format_table(_result(bare, mine, 50))
    assert "noise: of the CPU-time ratio, half the spread of 5 rounds;" in table


def test_a_variant_without_a_cycle_is_cut_into_blocks_of_ten_steps() -> None:
    bare, mine = _rounds(steps=40, rounds=1, sampled_every=1)
    found = band([1.0], mine, bare, steps_per_cycle=1)
    assert found is not None and found.block_steps == MIN_BLOCK_STEPS and found.blocks == 4


def test_a_monitors_cycle_is_the_lcm_of_its_cadences() -> None:
    assert cycle(None) == 1
    assert cycle(MonitorConfig()) == 50  # every 10, whole-model every 50, log every 50
    assert cycle(MonitorConfig(every=100, log_every=100)) == 500  # whole-model statistics every 500
    assert cycle(MonitorConfig(attn_every=20, log_every=30)) == 300  # lcm(10, 20, 50, 30)
    assert cycle(MonitorConfig(every=1, log_every=1)) == 1


def test_the_added_milliseconds_noise_is_the_standard_error_over_the_same_blocks() -> None:
    bare, mine = _rounds(steps=300, rounds=2)
    flags = [[i % 10 == 0 for i in range(300)] for _ in range(2)]
    extra = [
        0.0,
        0.4,
        0.0,
        -0.2,
        0.0,
        0.0,
        0.6,
        0.0,
        0.0,
        0.2,
        0.0,
        0.0,
    ]  # ms on each block's unsampled steps
    for k, ms in enumerate(extra):
        r, start = divmod(k, 6)
        for i in range(start * 50, start * 50 + 50):
            if not flags[r][i]:
                mine[r][i] += ms / 1e3
    result = _result(bare, mine, 50)
    result.variants["default"].step_sampled = flags
    added = added_ms(result, "default")
    unsampled, sampled = added["unsampled"], added["sampled"]
    assert unsampled is not None and sampled is not None
    per_block = 0.5 + np.array(extra)  # each block's mean over its 45 unsampled steps
    assert unsampled.noise == pytest.approx(per_block.std(ddof=1) / math.sqrt(12), rel=1e-6)
    assert unsampled.ms == pytest.approx(np.median([per_block[:6].mean(), per_block[6:].mean()]), rel=1e-6)
    assert sampled.ms == pytest.approx(10.0) and sampled.noise == pytest.approx(0.0, abs=1e-9)
