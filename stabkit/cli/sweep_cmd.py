"""`stabkit sweep RECIPE`: every variant over an LR grid, and the LR sensitivity of Wortsman et al. 2023."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .app import UserInputError, main, writable_dir
from .progress import MultiProgress
from .run_cmd import (
    exit_code,
    header,
    load_to_train,
    resolve_device,
    resolve_jobs,
    shared_options,
)


def parse_lrs(text: str | None) -> list[float] | None:
    """'1e-3,1e-2 3e-2' -> [0.001, 0.01, 0.03]; each must be a positive number."""
    if text is None:
        return None
    items = [t for t in text.replace(",", " ").split() if t]
    try:
        values = [float(t) for t in items]
    except ValueError:
        raise UserInputError(f"--lrs must be positive numbers separated by commas, got {text!r}") from None
    if not values or any(not (v > 0) or v == float("inf") for v in values):
        raise UserInputError(f"--lrs must be positive numbers separated by commas, got {text!r}")
    return sorted(set(values))


@main.command(name="sweep")
@click.argument("recipe")
@click.option("--lrs", default=None, help="Peak LRs, comma-separated (default: the recipe's [sweep] lrs).")
@shared_options
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="Output folder (default: runs/<recipe name>-sweep).",
)
def sweep_command(
    recipe: str,
    lrs: str | None,
    model: str | None,
    model_option: tuple[str, ...],
    size: str | None,
    device: str,
    steps: int | None,
    seed: int | None,
    jobs: int | None,
    data: str | None,
    out: str | None,
) -> None:
    """Train each variant of RECIPE (except reference runs) at every peak LR of a grid.

    Prints the loss and max attention logit per LR and the LR-sensitivity table over the whole grid
    and over its high end; writes OUT/sweep.json, OUT/lr_sweep.png (with the `plot` extra) and a
    TensorBoard run per (variant, LR) with hparams.
    """
    import torch

    from ..harness.recipes import run_sweep
    from ..harness.recipes.results.report import sweep_tables, verdict_lines
    from ..harness.recipes.science.sweep import SWEPT

    grid = parse_lrs(lrs)
    loaded, original = load_to_train(recipe, size, steps, seed, data, model, model_option)
    dev = resolve_device(device)
    workers = resolve_jobs(jobs, dev)
    if dev == "cpu":
        torch.set_num_threads(1)
    out_dir = writable_dir(out or Path("runs") / f"{loaded.name}-sweep", "--out")
    grid = grid or loaded.sweep.lrs
    click.echo(header(loaded, dev, workers, original))
    click.echo(f"  LR grid: {', '.join(f'{lr:g}' for lr in grid)}")
    names = [f"{v.name} lr={lr:g}" for lr in grid for v in loaded.variants if v.role in SWEPT]
    bars = MultiProgress(names, loaded.train.steps)
    try:
        summary = run_sweep(loaded, out_dir, lrs=grid, device=dev, workers=workers, on_progress=bars.update)
    finally:
        bars.close()
    click.echo("")
    click.echo(sweep_tables(summary))
    click.echo("")
    click.echo(verdict_lines(summary))
    click.echo("")
    if not summary.complete:
        click.echo("PARTIAL: " + ("interrupted" if summary.interrupted else "some runs did not finish"))
    click.echo(f"plot: {summary.plot}")
    click.echo(
        f"took {summary.seconds or 0:.0f} s; summary: {out_dir / 'sweep.json'}; view: tensorboard --logdir {out_dir}"
    )
    code = exit_code(summary)
    if code:
        sys.exit(code)
