"""`stabkit demo`: a tiny monitored training run on the embedded text (the 30-second tour)."""

from __future__ import annotations

import sys
from typing import Any

import click

from .app import main, writable_dir


@main.command()
@click.option("--size", default="tiny", show_default=True, type=click.Choice(["tiny", "small"]))
@click.option("--steps", default=200, show_default=True, type=click.IntRange(1, 1_000_000))
@click.option("--lr", default=3e-3, show_default=True, type=click.FloatRange(min=0, min_open=True))
@click.option("--logdir", default="runs/demo", show_default=True, type=click.Path(file_okay=False))
@click.option("--data", default=None, type=click.Path(), help="Your own text file (default: embedded text).")
@click.option("--seed", default=0, show_default=True, type=int)
def demo(size: str, steps: int, lr: float, logdir: str, data: str | None, seed: int) -> None:
    """Train the reference GPT for a few hundred steps with stabkit attached; open TensorBoard on LOGDIR."""
    import torch

    from ..config import MonitorConfig
    from ..harness.data import load_corpus
    from ..harness.models import GPT, PRESET_BATCH, preset_config
    from ..harness.training import TrainConfig, make_optimizer, train
    from ..monitor import attach

    folder = writable_dir(logdir, "--logdir")
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    corpus = load_corpus(data)
    cfg = preset_config(size)
    model = GPT(cfg)
    tcfg = TrainConfig(steps=steps, lr=lr, batch_size=PRESET_BATCH[size], seed=seed)
    mcfg = MonitorConfig(
        every=10, log_every=50, console=False, logdir_mode="overwrite"
    )  # a rerun replaces it
    progress: Any = click.progressbar(length=steps, label=f"training {size} GPT", file=sys.stderr)
    opt = make_optimizer(model, tcfg)
    monitor = attach(model, opt, logdir=folder, config=mcfg)
    with progress as bar:

        def on_step(step: int, loss: float) -> None:
            bar.update(1)

        result = train(
            model,
            corpus,
            tcfg,
            context=cfg.context,
            optimizer=opt,
            after_update=monitor.step,
            on_step=on_step,
            on_end=monitor.detach,  # also when training raises; the validation runs unmonitored
        )
    click.echo(
        f"loss {result.initial_loss:.3f} -> {result.final_loss:.3f} (validation {result.val_loss:.3f}); "
        f"statistics in {folder}; view with: tensorboard --logdir {folder.parent}"
    )
