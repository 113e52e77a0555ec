"""Tensor parallel (2 ranks) and FSDP2 x TP (2 x 2 ranks) under torchrun (gloo, CPU) against one process.

Each test launches `tests/dist_workers/tensor_parallel.py` (a tiny torchtitan-style Llama with
torchtitan's TP plan, or the zoo's Hugging Face Llama) with `python -m torch.distributed.run
--standalone`, and compares every statistic rank 0 logged with the same model trained in this
process on the whole global batch (`tensor_parallel.run("single...")`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from stabkit.sinks import read_jsonl

from . import launch

HERE = Path(__file__).parents[1]  # tests/
WORKER = HERE / "dist_workers" / "tensor_parallel.py"
sys.path.insert(0, str(HERE / "dist_workers"))

import tensor_parallel as worker  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed"),
    pytest.mark.multiprocess,
]

REL = 1e-5
"""Relative tolerance of every statistic against one process (measured: <= 4e-7 on the tiny Llama,
<= 3e-6 on the HF Llama, whose TP sums its row-parallel outputs in another order)."""
LOOSE = {"clip/z": 1e-4}
"""ZClip's z-score (g − μ) / σ with σ from one warm-up step (z ~ 4500) amplifies float rounding."""


def torchrun(scenario: str, out: Path, nproc: int = 2, timeout: float = 240.0) -> list[dict[str, Any]]:
    """Run the worker on `nproc` ranks; each rank's JSON result (`launch.torchrun`)."""
    return launch.torchrun(WORKER, scenario, out, nproc, timeout)


def single(scenario: str, out: Path) -> dict[str, Any]:
    """The same training in this process, on the whole global batch."""
    return worker.run(scenario, str(out))


def compare(ranks: list[dict[str, Any]], reference: dict[str, Any], split: bool) -> dict[str, float]:
    """Every statistic of rank 0 against one process; the largest relative error per statistic kind."""
    for r in ranks[1:]:
        assert r["history"] == ranks[0]["history"], "every rank must get the same reduced values"
        assert r["events"] == ranks[0]["events"], "every rank must report the same events"
    assert [r["mode"] for r in ranks] == ["sharded"] * len(ranks)
    worst = launch.worst_errors(
        ranks[0]["history"], reference["history"], worker.STEPS, split, lambda n: LOOSE.get(n, REL)
    )
    mean_loss = [sum(step) / len(ranks) for step in zip(*(r["losses"] for r in ranks), strict=True)]
    assert mean_loss == pytest.approx(reference["losses"], rel=REL, nan_ok=True)  # equal data shares
    assert ranks[0]["events"] == reference["events"]
    return worst


def one_writer(logdir: Path) -> None:
    """Rank 0 alone wrote: one TensorBoard file, each step logged once."""
    launch.one_writer(logdir, worker.STEPS)


def test_tp_every_statistic_equals_one_process(tmp_path: Path) -> None:
    """TP over 2 ranks, replicated norms and residual stream: the embedding's gradient comes Replicate
    for a Shard(0) weight, the norm weights are plain tensors; per-layer activation, attention and
    logit statistics are found (the blocks sit in a ModuleDict, as in torchtitan)."""
    ranks = torchrun("tp", tmp_path / "tp")
    worst = compare(ranks, single("single", tmp_path / "single"), split=False)
    names = ranks[0]["history"][0][1]
    for name in ("act/layers.1.feed_forward/rms", "attn/layers.1.attention/max_logit", "grad/layers.1/norm"):
        assert name in names
    assert worst["grad/norm"] > 0 and worst["attn/max_logit"] > 0  # compared, and within REL
    one_writer(tmp_path / "tp" / "run")


def test_tp_sequence_and_loss_parallel_nan_named_alike_on_every_rank(tmp_path: Path) -> None:
    """TP with sequence parallel (Partial gradients of the norm weights) and loss parallel (logits
    sharded over the vocabulary): every statistic as one process; a NaN made in rank 1's shard of
    one q projection is named at that module on both ranks, and both skip the step."""
    ranks = torchrun("tp_sp+lp+nan", tmp_path / "sp")
    compare(ranks, single("single+nan", tmp_path / "single"), split=False)
    for r in ranks:
        assert r["events"] == [[worker.NAN_STEP, "nonfinite", worker.NAN_MODULE, True]]
    events = [e for e in read_jsonl(tmp_path / "sp" / "run" / "stabkit.jsonl") if e["type"] == "event"]
    assert [(e["step"], e["where"]) for e in events] == [(worker.NAN_STEP, worker.NAN_MODULE)]


FLAT_NAMES = ("act/layers.0.attention/rms", "act/layers.0.w2/rms", "attn/layers.1.attention/head.3/entropy")
"""Logged by one process for the decoder whose blocks hold attention, w1, w2, w3 directly (by the
trace: no MLP module to find by name) with per-head statistics (4 heads: the last one, global index)."""
SPLIT_KINDS = {
    "attn/min_head_entropy",
    "attn/first_key_mass",
    "attn/sink_heads",
    "act/kurtosis",
    "act/massive_dim",
}
"""Statistics a split batch or split heads used to leave per rank (`launch.SPLIT_ROWS`): compared too."""


def test_tp_flat_blocks_log_what_one_process_logs(tmp_path: Path) -> None:
    """TP over 2 ranks on blocks holding attention, w1, w2, w3 directly (torchtitan's plan: q/k/v and
    w1 colwise, o and w2 rowwise): discovery traces the model the shards make up, so rank 0 logs the
    same metric names as one process, every value within REL — per-head statistics numbered by
    global head (each rank computes 2 of the 4), the per-head minima and maxima included."""
    ranks = torchrun("tp+flat+heads", tmp_path / "tp")
    worst = compare(ranks, single("single+flat+heads", tmp_path / "single"), split=False)
    assert set(FLAT_NAMES) <= set(ranks[0]["history"][0][1])
    assert set(worst) >= SPLIT_KINDS


def test_fsdp2_x_tp_2x2_norms_and_clip_equal_one_process(tmp_path: Path) -> None:
    """FSDP2 (2) x TP (2): the norm weights, left alone by the TP plan, are sharded on the data-parallel
    mesh only and held twice (once per TP rank); gradient, parameter and update norms count them once.
    The clip action clips every rank by the one global norm (losses and clip/* as one process). Blocks
    hold attention, w1, w2, w3 directly and per-head statistics are on: the same names as one process,
    and every statistic within REL although the batch is split over the data-parallel ranks and the
    heads over the TP ranks (per-head sums and counts reduced by sum, maxima by max, divided after)."""
    ranks = torchrun("fsdp_tp+clip+flat+heads", tmp_path / "fsdp_tp", nproc=4)
    worst = compare(ranks, single("single+clip+flat+heads", tmp_path / "single"), split=False)
    assert {"grad/norm", "param/norm", "update/ratio", "clip/pre_norm", "clip/post_norm"} <= set(worst)
    assert set(worst) >= SPLIT_KINDS
    assert set(FLAT_NAMES) <= set(ranks[0]["history"][0][1])
    assert ranks[0]["history"][-1][1]["clip/did_clip"] == 1.0
    one_writer(tmp_path / "fsdp_tp" / "run")


def test_interventions_under_tp_apply_or_refuse(tmp_path: Path) -> None:
    """HF Llama under TP: attn_softcap and z_loss at attach give the one-process statistics; qk_norm,
    which adds parameters no rank would reduce, is refused with what to do instead."""
    ranks = torchrun("tp+hf+softcap+zloss+qk_norm", tmp_path / "hf")
    compare(ranks, single("single+hf+softcap+zloss", tmp_path / "single"), split=False)
    assert "logits/z_loss" in ranks[0]["history"][0][1]
    for r in ranks:
        assert "qk_norm" in r["refused"] and "DTensors" in r["refused"] and "before sharding" in r["refused"]
