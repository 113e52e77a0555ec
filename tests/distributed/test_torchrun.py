"""DDP and FSDP2 under torchrun (2 ranks, gloo, CPU) against the same training on one process.

Each test launches `tests/dist_workers/train.py` with `python -m torch.distributed.run
--standalone` (a free rendezvous port) and compares what rank 0 logged with what one process
logs on the whole global batch.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from stabkit.sinks import read_jsonl

from . import launch
from .launch import SPLIT_ROWS, statistic_floor

HERE = Path(__file__).parents[1]  # tests/
WORKER = HERE / "dist_workers" / "train.py"
sys.path.insert(0, str(HERE / "dist_workers"))

from common import CLIP, GLOBAL_BATCH, STEPS, single_process_rows  # noqa: E402
from zoo import SEQ  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed"),
    pytest.mark.multiprocess,
]

EXACT = ("grad/", "param/", "update/", "loss", "logits/")
EXACT_STATS = ("/absmax", "/nonfinite", "/max_logit", "/entropy", *SPLIT_ROWS)
"""Metrics equal to the one-process value under a split batch: by their declared reduction, or made
from parts after it (`SPLIT_ROWS`: minima and maxima over heads of per-head means, the channel of the
largest activation, the kurtosis — `stabkit/probes/split_exact.py`). Not here: `act/*/rms` (declared
'l2' in probes/activations.py, which gives √world × the RMS; 'rms' would be exact)."""


def torchrun(scenario: str, out: Path, nproc: int = 2, timeout: float = 150.0) -> list[dict[str, Any]]:
    """Run the worker on `nproc` ranks; each rank's JSON result (`launch.torchrun`)."""
    return launch.torchrun(WORKER, scenario, out, nproc, timeout)


def rel(a: float, b: float, floor: float = 1e-12) -> float:
    return abs(a - b) / max(abs(b), floor)


def check_against_single(
    ranks: list[dict[str, Any]], logdir: Path, single_dir: Path, **overrides: object
) -> None:
    history = {int(step): values for step, values in ranks[0]["history"]}
    assert ranks[1]["history"] == ranks[0]["history"], "every rank must get the same reduced values"
    reference = single_process_rows(str(single_dir), **overrides)
    assert sorted(history) == sorted(reference) == list(range(STEPS))
    assert reference[0]["grad/global_norm"] > 2 * CLIP, "the norms must be the ones before clipping"
    compared = 0
    for step, ref in reference.items():
        assert set(history[step]) == set(ref), step
        for name, want in ref.items():
            if name.startswith(EXACT) or name.endswith(EXACT_STATS):
                err = rel(history[step][name], want, statistic_floor(name))
                assert err <= 1e-5, (step, name, history[step][name], want)
                compared += 1
    assert compared >= 35 * STEPS  # per step: 25 norms, ratios, logits and loss; 14 act / attn maxima
    # one event directory, written by rank 0 alone: one TensorBoard file, each step logged once
    assert len(list(logdir.glob("events.out.tfevents.*"))) == 1
    logged = [r["step"] for r in read_jsonl(logdir / "stabkit.jsonl") if r["type"] == "metrics"]
    assert logged == list(range(STEPS))


def test_ddp_grad_norms_equal_single_process(tmp_path: Path) -> None:
    ranks = torchrun("ddp", tmp_path / "ddp")
    assert [r["mode"] for r in ranks] == ["replicated", "replicated"]
    check_against_single(ranks, tmp_path / "ddp" / "run", tmp_path / "single")


def test_ddp_moe_router_statistics_equal_single_process(tmp_path: Path) -> None:
    """Loads are counted per rank and summed before MaxVio, CV, busiest share and dead experts are
    taken; entropy, margin and router log Z reduce like the other statistics: every moe/ value on
    2 ranks equals one process on the whole batch."""
    ranks = torchrun("ddp_moe", tmp_path / "ddp_moe")
    assert [r["mode"] for r in ranks] == ["replicated", "replicated"]
    assert ranks[1]["history"] == ranks[0]["history"]
    history = {int(step): values for step, values in ranks[0]["history"]}
    reference = single_process_rows(str(tmp_path / "single"), moe=True)
    compared = 0
    for step, ref in reference.items():
        moe = {n: v for n, v in ref.items() if n.startswith("moe/")}
        assert {n for n in history[step] if n.startswith("moe/")} == set(moe), step
        loads = [v for n, v in moe.items() if "/load" in n and n.rsplit("/", 1)[-1].startswith("load[")]
        assert sum(loads) == 2 * 2 * GLOBAL_BATCH * SEQ, (step, loads)  # top-2 of 4, 2 layers, every token
        for name, want in moe.items():
            got = history[step][name]
            assert (math.isnan(got) and math.isnan(want)) or rel(got, want, 1e-6) <= 1e-5, (
                step,
                name,
                got,
                want,
            )
            compared += 1
    assert compared >= 20 * STEPS


def test_fsdp2_per_block_and_global_norms_equal_unsharded(tmp_path: Path) -> None:
    ranks = torchrun("fsdp", tmp_path / "fsdp")
    assert [r["mode"] for r in ranks] == ["sharded", "sharded"]
    check_against_single(ranks, tmp_path / "fsdp" / "run", tmp_path / "single", detect=None)
    names = ranks[0]["history"][0][1]
    assert "grad/blocks.1/norm" in names and "update/blocks.1/ratio" in names
    assert not [n for n in names if n.endswith((".num", ".den"))]


def test_reduce_and_agree_on_known_values(tmp_path: Path) -> None:
    # rank r holds [r+1, 2r+1, 3-r, r+5, 3r+4, r+1, (0 | NaN), (-1 | inf)]
    want = [1.5, 4.0, 3.0, 5.0, math.sqrt(4**2 + 7**2), math.sqrt((1 + 4) / 2), math.nan, -1.0]
    for result in torchrun("reduce", tmp_path / "reduce"):
        for key in ("gather", "sum_max"):
            got = result[key]
            assert math.isnan(got[6]), "a NaN on one rank must survive a max"
            assert [round(x, 5) for i, x in enumerate(got) if i != 6] == [
                round(x, 5) for i, x in enumerate(want) if i != 6
            ]
        assert result["agree"] is True and result["agree_dtype"] == "torch.bool"
        for own, warned in result["mismatched"]:
            assert own == result["values"][:2]
            assert warned and warned[0].startswith("stabkit: ranks recorded different statistics")


def test_nan_on_rank1_only_skips_the_same_step_on_both_ranks(tmp_path: Path) -> None:
    """A NaN on one rank only: the ranks agree on the non-finite step (one collective), so both skip
    the same update and rank 0 logs one event."""
    ranks = torchrun("nan", tmp_path / "nan")
    from train import NAN_STEP  # the worker's constants

    expected = [step != NAN_STEP for step in range(STEPS)]
    for r in ranks:
        assert r["changed"] == expected, (r["rank"], r["changed"])  # the update of NAN_STEP skipped
        assert r["finite_end"], r["rank"]
    events = [e for e in read_jsonl(tmp_path / "nan" / "run" / "stabkit.jsonl") if e["type"] == "event"]
    assert [(e["step"], e["kind"], e["details"].get("skipped_update")) for e in events] == [
        (NAN_STEP, "nonfinite", True)
    ]
