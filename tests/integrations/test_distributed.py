"""`transformers.Trainer` with StabkitCallback under torchrun (2 ranks, DDP through accelerate,
gloo on the CPU, gradient accumulation with no_sync): stabkit's grad norm and loss of each step
equal the ones the Trainer computes and logs itself, and only rank 0 writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parents[1]  # tests/
WORKER = HERE / "dist_workers" / "hf_trainer.py"

pytestmark = pytest.mark.multiprocess


def test_hf_trainer_ddp_norms_and_loss_match_the_trainers_own(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STABKIT_TEST_HANG_S": "120"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*cmd, str(WORKER), str(tmp_path)], env=env, capture_output=True, text=True, timeout=150
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["mode"] for r in ranks] == ["replicated", "replicated"]
    assert ranks[0]["history"] == ranks[1]["history"]
    trainer = {int(k): v for k, v in ranks[0]["trainer"].items()}
    history = dict((step, values) for step, values in ranks[0]["history"])
    assert sorted(history) == sorted(trainer) == list(range(6))
    for step, logs in trainer.items():
        # the Trainer's grad_norm: torch's clip_grad_norm_ on the averaged gradients, before clipping
        assert history[step]["grad/global_norm"] == pytest.approx(logs["grad_norm"], rel=1e-4), step
        assert history[step]["loss"] == pytest.approx(logs["loss"], abs=1e-3), step  # logs are rounded
    assert len(list((tmp_path / "stabkit").glob("events.out.tfevents.*"))) == 1
