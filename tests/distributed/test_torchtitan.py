"""torchtitan's own Llama 3, parallelised by its own `parallelize_llama` (TP 2), monitored by stabkit on
2 gloo CPU processes, against the same model in one process.

`tests/dist_workers/torchtitan_worker.py` says what CPU processes needed (torchtitan 0.3.0). Forward
statistics only: torchtitan's Llama 3 attends with FlexAttention (or varlen), which has no backward on
a CPU, so the forwards run in training mode with grad enabled on frozen parameters (stabkit attached
before they were frozen). Its trainer is GPU-only (docs/guide/distributed.md, "torchtitan").
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

pytest.importorskip("torchtitan")


from . import launch

HERE = Path(__file__).parents[1]  # tests/
WORKER = HERE / "dist_workers" / "torchtitan_worker.py"
sys.path.insert(0, str(HERE / "dist_workers"))

import torchtitan_worker as worker  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed"),
    pytest.mark.multiprocess,
]

REL = 1e-5
"""Relative tolerance against one process (measured: <= 4.8e-6, logits/mean of ~-7e-3; the rest <= 4e-7)."""
STATS = (
    "act/layers.1.feed_forward/rms",
    "attn/layers.0.attention/max_logit",
    "attn/layers.1.attention/entropy",
)


def torchrun(scenario: str, out: Path, nproc: int = 2, timeout: float = 240.0) -> list[dict[str, Any]]:
    """Run the worker on `nproc` ranks; each rank's JSON result (`launch.torchrun`)."""
    return launch.torchrun(WORKER, scenario, out, nproc, timeout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The unparallelised model in this process, on the same batches."""
    return worker.run("single", str(tmp_path_factory.mktemp("single")))


def compare(ranks: list[dict[str, Any]], reference: dict[str, Any], split: bool) -> dict[str, float]:
    """Every forward statistic rank 0 logged against one process; the largest relative error per kind."""
    assert ranks[1]["history"] == ranks[0]["history"], "every rank must get the same reduced values"
    assert [r["mode"] for r in ranks] == ["sharded", "sharded"]
    assert [r["wqkv"] for r in ranks] == [["DTensor", [96, 64]]] * 2  # q/k/v really split over 2 ranks
    worst = launch.worst_errors(ranks[0]["history"], reference["history"], worker.STEPS, split, lambda n: REL)
    assert ranks[0]["losses"] == pytest.approx(reference["losses"], rel=REL)
    return worst


@pytest.mark.parametrize("scenario", ["tp", "tp_sp"])
def test_torchtitan_llama3_tp_forward_statistics_equal_one_process(
    scenario: str, tmp_path: Path, reference: dict[str, Any]
) -> None:
    """TP 2 (and with sequence parallel): activations over the full hidden size, attention logits read
    from torchtitan's compiled FlexAttention on each rank's 2 of 4 heads, the output logits: as one
    process. The roles come from the docs' model_map; only rank 0 writes."""
    ranks = torchrun(scenario, tmp_path / scenario)
    for name in STATS:
        assert name in reference["history"][0][1]
    worst = compare(ranks, reference, split=scenario == "tp_sp")
    assert {"act/rms", "attn/max_logit", "attn/entropy", "logits/logz_mean", "logits/max_abs"} <= set(worst)
    launch.one_writer(tmp_path / scenario / "run", worker.STEPS)  # rank 0 alone wrote, each step once
