"""Under the Hugging Face Trainer stabkit's ``grad/global_norm`` is the Trainer's own logged
``grad_norm`` (the accumulated gradient's norm before it clips) at every optimizer step, with
gradient accumulation and a clip that acts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from zoo import batch, hf_gpt2

import stabkit

STEPS = 6
CLIP = 0.1


class TokenRows(torch.utils.data.Dataset):
    """A tiny in-memory causal-LM dataset (input_ids are their own labels)."""

    def __len__(self) -> int:
        return 8 * STEPS

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, _ = batch(i, bsz=1)
        return {"input_ids": x[0], "labels": x[0]}


def test_hf_trainer_grad_norm_equals_stabkit_at_every_step(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from stabkit.integrations.hf import StabkitCallback

    logged: dict[int, float] = {}

    class TrainerNorm(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "grad_norm" in logs:
                logged[state.global_step - 1] = float(logs["grad_norm"])

    torch.manual_seed(0)
    config = stabkit.MonitorConfig(every=1, log_every=1000, console=False, audit=False)
    callback = StabkitCallback(config=config)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_grad_norm=CLIP,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=hf_gpt2(), args=args, train_dataset=TokenRows(), callbacks=[callback, TrainerNorm()]
    )
    trainer.train()
    mon = callback.monitor
    assert mon is not None
    ours = {step: values["grad/global_norm"] for step, values in mon.history if "grad/global_norm" in values}
    assert sorted(ours) == sorted(logged) == list(range(STEPS))
    assert [ours[s] for s in range(STEPS)] == pytest.approx([logged[s] for s in range(STEPS)], rel=1e-5)
    assert min(logged.values()) > 2 * CLIP  # the clip acted: a norm read after it would differ
