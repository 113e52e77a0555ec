"""STABKIT_DISABLE=1 under the Hugging Face Trainer: the callback gets the no-op monitor, hooks nothing,
writes nothing, and the run's losses are those of a run without the callback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from integrations.test_callbacks import TokenRows
from zoo import hf_gpt2

from stabkit.disabled import DisabledMonitor

STEPS = 6


def _train(tmp_path: Path, with_callback: bool) -> tuple[list[float], Any]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from stabkit.integrations.hf import StabkitCallback

    losses: list[float] = []

    class Losses(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    torch.manual_seed(0)
    callback = StabkitCallback()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    extra = [callback] if with_callback else []
    model = hf_gpt2()
    Trainer(model=model, args=args, train_dataset=TokenRows(), callbacks=[*extra, Losses()]).train()
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    return losses, (callback, hooks)


def test_hf_trainer_with_stabkit_disabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("accelerate")
    bare, _ = _train(tmp_path / "bare", with_callback=False)
    monkeypatch.setenv("STABKIT_DISABLE", "1")
    losses, (callback, hooks) = _train(tmp_path / "off", with_callback=True)
    assert isinstance(callback.monitor, DisabledMonitor)
    assert callback.monitor.global_step == STEPS  # one step per optimizer step, as when monitoring
    assert hooks == 0 and not (tmp_path / "off" / "stabkit").exists()
    assert losses == bare and len(losses) == STEPS
