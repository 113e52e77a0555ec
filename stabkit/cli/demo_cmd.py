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

    from ..attaching import attach
    from ..config import MonitorConfig
    from ..harness.data import load_corpus
    from ..harness.models import GPT, PRESET_BATCH, preset_config
    from ..harness.training import Callbacks, TrainConfig, TrainRun, evaluate, train

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
    run = TrainRun(model, corpus, tcfg, cfg.context)
    monitor = attach(model, run.optimizer, logdir=folder, config=mcfg, scaler=run.amp.scaler)
    with progress as bar:

        def on_step(step: int, loss: float) -> None:
            bar.update(1)

        # on_end: also when training raises; the validation runs unmonitored
        result = train(run, Callbacks(after_update=monitor.step, on_step=on_step, on_end=monitor.detach))
    val = evaluate(
        model, corpus, batches=tcfg.eval_batches, batch_size=tcfg.batch_size, context=cfg.context, amp=run.amp
    )
    click.echo(
        f"loss {result.initial_loss:.3f} -> {result.final_loss:.3f} (validation {val.val_loss:.3f}); "
        f"statistics in {folder}; view with: tensorboard --logdir {folder.parent}"
    )
    for line in found(monitor, folder):
        click.echo(line)


def found(monitor: Any, folder: Any) -> list[str]:
    """After the demo's training: what the detectors found, one line per incident (the events of one
    cause), the distinct advice, and where to read more."""
    events = list(monitor.events)
    if not events:
        return ["events: none (the detectors found nothing to report)"]
    incidents = list(getattr(getattr(monitor, "incidents", None), "incidents", []))
    lines = [f"events: {len(events)}" + (f" in {len(incidents)} incident(s)" if incidents else "")]
    if incidents:
        lines += [f"  {i.severity:<8} {i.headline()}" for i in incidents]
    else:
        lines += [f"  {e.severity:<8} {e}" for e in events]
    lines += [f"  advice: {a}" for a in dict.fromkeys(e.advice for e in events if e.advice)]
    lines.append(f"every event: stabkit report {folder} --members; a picture: add --plot demo.png")
    return lines
