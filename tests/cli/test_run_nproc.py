"""`stabkit run RECIPE --nproc N`: each variant trains with DDP on N processes (gloo on the CPU).

The end-to-end test runs a shortened recipe on one process and on two, and compares what the
baseline and qk_norm logged at their first steps: the same global batch split over two ranks must
give the same loss and gradient norm as one process (to rounding). Helpers that need no process
group (row sharding, the rank-0-only summary, intervention metrics) are tested in this process.
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from cli_process import StabkitCLI, logged, wait_until
from click.testing import CliRunner

from stabkit.cli import main
from stabkit.distributed import DistContext
from stabkit.harness.data import load_corpus
from stabkit.harness.recipes import load_recipe, run_recipe
from stabkit.harness.recipes.results.run_result import RunResult
from stabkit.harness.recipes.run.ddp import RankRows
from stabkit.harness.recipes.run.worker import Job, run_job
from stabkit.sinks import LOG_NAME, read_jsonl

FIRST_STEPS = 5
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")


def metrics(logdir: Path) -> list[tuple[int, dict[str, float]]]:
    return [(r["step"], r["values"]) for r in read_jsonl(logdir / LOG_NAME) if r["type"] == "metrics"]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.multiprocess
def test_two_processes_log_what_one_process_logs(tmp_path: Path, stabkit_cli: StabkitCLI) -> None:
    common = ["run", "attention-logit-growth", "--size", "tiny", "--steps", "20", "--seed", "0"]
    one = stabkit_cli.run(*common, "--jobs", "1", "--out", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr[-3000:]
    two = stabkit_cli.run(*common, "--nproc", "2", "--out", str(tmp_path / "two"))
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-4000:]

    # rank 0 alone printed: one header, one table, one summary line
    assert two.stdout.count("DDP over 2 processes (gloo)") == 1
    assert two.stdout.count("\nvariant ") == 1 and two.stdout.count("summary: ") == 1
    out = tmp_path / "two"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] is True and summary["processes"] == 2
    assert sorted(p.name for p in out.iterdir()) == sorted([*summary["variants"], "summary.json"])
    single = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert single["processes"] == 1
    for name, result in summary["variants"].items():
        assert result["status"] == "done" and result["steps_done"] == 20
        assert result["rows_per_process"] == 8  # each rank trained on half of each 16-row batch
        # one TensorBoard event file per variant, and every step logged once (rank 0 wrote alone)
        assert len(list((out / name).glob("events.out.tfevents.*"))) == 1
        assert [s for s, _ in metrics(out / name)] == list(range(20))
        # the held-out loss before training is measured on the whole model on every rank
        assert result["init_val_loss"] == pytest.approx(single["variants"][name]["init_val_loss"], rel=1e-6)

    compared = 0
    for name in ("baseline", "qk_norm"):  # qk_norm: new gains applied before the DDP wrap, trained
        ref, got = metrics(tmp_path / "one" / name), metrics(out / name)
        for (step, want), (_, have) in zip(ref[:FIRST_STEPS], got[:FIRST_STEPS], strict=True):
            for key in ("loss", "grad/global_norm"):
                assert rel(have[key], want[key]) <= 1e-5, (name, step, key, have[key], want[key])
                compared += 1
        # the loss the summary reports is the mean over ranks, i.e. the global batch's loss
        s1, s2 = single["variants"][name], summary["variants"][name]
        assert rel(s2["initial_loss"], s1["initial_loss"]) <= 1e-5
    assert compared == 2 * 2 * FIRST_STEPS


def test_nproc_bad_combinations_exit_2_with_one_line() -> None:
    for args, needle in (
        (["--nproc", "2", "--jobs", "2"], "--jobs 2"),
        (["--nproc", "3"], "split evenly over 3 processes"),  # the tiny batch is 16 rows
    ):
        result = CliRunner().invoke(main, ["run", "attention-logit-growth", "--steps", "3", *args])
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0] and not result.stdout, lines


@pytest.mark.multiprocess
@pytest.mark.signals
def test_ctrl_c_stops_every_rank_at_the_same_step(tmp_path: Path, stabkit_cli: StabkitCLI) -> None:
    out = tmp_path / "int"
    proc = stabkit_cli.start(
        "run", "attention-logit-growth", "--steps", "3000", "--nproc", "2", "--out", str(out)
    )
    wait_until(logged(out / "baseline" / LOG_NAME))
    assert proc.poll() is None, proc.communicate()
    os.kill(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["complete"] is False and summary["interrupted"] is True
    base = summary["variants"]["baseline"]
    assert base["status"] == "interrupted" and 0 < base["steps_done"] < 3000
    assert {r["status"] for n, r in summary["variants"].items() if n != "baseline"} == {"not run"}
    rows = [s for s, _ in metrics(out / "baseline")]
    assert rows == list(range(len(rows))) and len(rows) >= base["steps_done"] - 1  # flushed, no gap
    assert "PARTIAL: interrupted" in stdout and "Traceback" not in stderr


def test_rank_rows_split_the_global_batch() -> None:
    corpus = load_corpus()
    whole = corpus.batch("train", 8, 16, torch.Generator().manual_seed(3))
    parts = [
        RankRows.for_rank(corpus, 8, DistContext(True, r, 2)).batch(
            "train", 8, 16, torch.Generator().manual_seed(3)
        )
        for r in range(2)
    ]
    for i in range(2):  # inputs and targets: the two shares, in rank order, are the global batch
        assert torch.equal(torch.cat([p[i] for p in parts]), whole[i])
    assert [p[0].shape[0] for p in parts] == [4, 4]
    val = RankRows(corpus, slice(0, 4)).batch("val", 8, 16, torch.Generator().manual_seed(3))
    assert val[0].shape == (8, 16)  # validation batches stay whole
    with pytest.raises(ValueError, match="does not split evenly"):
        RankRows.for_rank(corpus, 8, DistContext(True, 0, 3))


@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_0_writes_the_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int) -> None:
    recipe = load_recipe("attention-logit-growth", "tiny", steps=2)
    seen: list[Any] = []

    def fake_execute(jobs: list[Job], workers: int, on_progress: Any, on_result: Any, stop: Any) -> bool:
        seen.extend((job.ddp, workers) for job in jobs)
        for job in jobs:
            on_result(job, RunResult(job.variant, job.name, job.logdir, "done", role="baseline"))
        return False

    monkeypatch.setattr("stabkit.harness.recipes.run.runner.execute", fake_execute)
    summary = run_recipe(recipe, tmp_path, workers=2, dist=DistContext(True, rank, 2))
    assert summary.complete is True and summary.processes == 2
    assert seen == [(True, 1)] * len(recipe.variants)  # data-parallel jobs, one at a time
    assert (tmp_path / "summary.json").exists() == (rank == 0)


def test_intervention_metrics_are_logged(tmp_path: Path) -> None:
    recipe = load_recipe("output-logit-divergence", "tiny", steps=11)
    coef = recipe.variant("z_loss").interventions["z_loss"]["coef"]
    result = run_job(Job(recipe, "z_loss", str(tmp_path)))
    assert result.status == "done"
    rows = metrics(tmp_path)
    assert all("logits/z_loss" in v for _, v in rows) and len(rows) == 11
    checked = 0
    for _, v in rows:
        if (
            "logits/logz_mean" in v
        ):  # same forward: coef·mean(lse²) lies between coef·mean(lse)² and coef·max(lse)²
            assert coef * v["logits/logz_mean"] ** 2 <= v["logits/z_loss"] * (1 + 1e-5)
            assert v["logits/z_loss"] <= coef * v["logits/logz_max"] ** 2 * (1 + 1e-5)
            checked += 1
    assert checked >= 2 and all(math.isfinite(v["logits/z_loss"]) for _, v in rows)
