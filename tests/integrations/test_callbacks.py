"""The framework callbacks: a 20-step `transformers.Trainer` run and a 20-step Lightning run each
write the expected TensorBoard tags, one value per optimizer step, and the loss of each step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from zoo import SEQ, VOCAB, batch, hf_gpt2, lm_loss, reference_gpt

import stabkit

STEPS = 20
CONFIG = dict(every=5, deep_every=10, log_every=5, console=False, audit=False)


def scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series TensorBoard reads back from `logdir`: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def check_tags(series: dict[str, list[tuple[int, float]]], block: str, attn: str) -> None:
    every_step = ["loss", "grad/global_norm"]
    sampled = [
        f"grad/{block}/norm",
        f"act/{block}/rms",
        f"attn/{attn}/max_logit",
        "logits/logz_max",
    ]
    deep = [f"param/{block}/norm", f"update/{block}/ratio"]  # the whole-model cadence, `deep_every`
    missing = [t for t in every_step + sampled + deep if t not in series]
    assert not missing, (missing, sorted(series)[:40])
    for tag in every_step:
        assert [s for s, _ in series[tag]] == list(range(STEPS)), tag
    for tag in sampled:
        assert [s for s, _ in series[tag]] == list(range(0, STEPS, CONFIG["every"])), tag  # type: ignore[arg-type]
    for tag in deep:
        assert [s for s, _ in series[tag]] == list(range(0, STEPS, CONFIG["deep_every"])), tag  # type: ignore[arg-type]


# ---------------------------------------------------------------- transformers.Trainer
class TokenRows(torch.utils.data.Dataset):
    """A tiny in-memory causal-LM dataset (input_ids are their own labels)."""

    def __len__(self) -> int:
        return 200

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x, _ = batch(i, bsz=1)
        return {"input_ids": x[0], "labels": x[0]}


def test_hf_trainer_run_writes_tags_and_per_step_loss(tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from stabkit.integrations.hf import StabkitCallback

    logged: dict[int, float] = {}

    class TrainerLoss(TrainerCallback):
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                logged[state.global_step - 1] = float(logs["loss"])

    torch.manual_seed(0)
    callback = StabkitCallback(config=stabkit.MonitorConfig(**CONFIG))  # type: ignore[arg-type]
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
    trainer = Trainer(
        model=hf_gpt2(), args=args, train_dataset=TokenRows(), callbacks=[callback, TrainerLoss()]
    )
    trainer.train()
    assert callback.monitor is not None and not callback.session.live  # detached at the end
    # the Trainer's schedule reaches the audit and the detectors (no warmup here: warmup_steps 0)
    assert callback.monitor.schedule == {"lr": 1e-3, "warmup_steps": 0}
    series = scalars(tmp_path / "stabkit")
    check_tags(series, "transformer.h.1", "transformer.h.1.attn")
    assert len(logged) == STEPS
    for step, value in series["loss"]:  # the Trainer's own per-step loss (it rounds to 4 digits)
        assert value == pytest.approx(logged[step], abs=1e-3), step


# ---------------------------------------------------------------- Lightning
def test_lightning_run_writes_tags_and_per_step_loss(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from stabkit.integrations.lightning import StabkitCallback

    micro_losses: list[float] = []

    class LitGPT(pl.LightningModule):  # type: ignore[name-defined,misc]
        def __init__(self) -> None:
            super().__init__()
            self.model = reference_gpt()

        def training_step(self, data: Any, index: int) -> torch.Tensor:
            x, y = data
            loss = lm_loss(self.model(x), y)
            micro_losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    x = torch.randint(0, VOCAB, (4 * STEPS, SEQ + 1), generator=torch.Generator().manual_seed(0))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:]), batch_size=2)
    callback = StabkitCallback(config=stabkit.MonitorConfig(**CONFIG))  # type: ignore[arg-type]
    trainer = pl.Trainer(
        max_steps=STEPS,
        accumulate_grad_batches=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        callbacks=[callback],
    )
    trainer.fit(LitGPT(), data)
    assert callback.monitor is not None and not callback.session.live  # detached at the end
    series = scalars(tmp_path / "stabkit")
    check_tags(series, "model.blocks.1", "model.blocks.1.attn")
    want = [(micro_losses[2 * s] + micro_losses[2 * s + 1]) / 2 for s in range(STEPS)]
    assert [v for _, v in series["loss"]] == pytest.approx(want, rel=1e-5)
