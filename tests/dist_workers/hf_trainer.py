"""One rank of a 2-rank `transformers.Trainer` run (DDP through accelerate, CPU) with StabkitCallback.

Usage: python -m torch.distributed.run --standalone --nproc_per_node 2 hf_trainer.py OUT
Writes OUT/rank<r>.json: stabkit's history on this rank and the Trainer's own logs (loss, grad_norm).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from transformers import Trainer, TrainerCallback, TrainingArguments
from zoo import batch, hf_gpt2

import stabkit
from stabkit.integrations.hf import StabkitCallback

STEPS = 6


class Rows(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 200

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, _ = batch(i, bsz=1)
        return {"input_ids": x[0], "labels": x[0]}


class TrainerLogs(TrainerCallback):
    def __init__(self) -> None:
        self.logs: dict[int, dict[str, float]] = {}

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.logs[state.global_step - 1] = {k: float(logs[k]) for k in ("loss", "grad_norm")}


def main() -> None:
    out = sys.argv[1]
    faulthandler.dump_traceback_later(float(os.environ.get("STABKIT_TEST_HANG_S", "90")), exit=True)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    stabkit_cb = StabkitCallback(config=stabkit.MonitorConfig(every=2, log_every=4, console=False))
    seen = TrainerLogs()
    args = TrainingArguments(
        output_dir=out,
        max_steps=STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    Trainer(model=hf_gpt2(), args=args, train_dataset=Rows(), callbacks=[stabkit_cb, seen]).train()
    rank = torch.distributed.get_rank()
    mon = stabkit_cb.monitor
    assert mon is not None
    result = {"rank": rank, "mode": mon.dist.mode, "history": list(mon.history), "trainer": seen.logs}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)
    # as `entry.worker_main`: the result is written; leave without the interpreter's teardown, where
    # a gloo run aborts once in a while ("terminate called without an active exception", exit -6)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
