"""`stabkit lead-time [RECIPE...]`: how early stabkit warns before a run is lost, over seeds."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .app import UserInputError, main, writable_dir
from .progress import MultiProgress
from .run_cmd import model_spec, resolve_device, resolve_jobs, with_options


@main.command(name="lead-time")
@click.argument("recipes", nargs=-1)
@click.option("--seeds", type=click.IntRange(1, 1000), default=3, show_default=True, help="Seeds 0..N-1.")
@with_options("model", "model_option", "size", "device", "steps", "jobs", "data")
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="Output folder (default: runs/lead-time); finished (recipe, seed) runs there are reused.",
)
def lead_time_command(
    recipes: tuple[str, ...],
    seeds: int,
    model: str | None,
    model_option: tuple[str, ...],
    size: str | None,
    device: str,
    steps: int | None,
    jobs: int | None,
    data: str | None,
    out: str | None,
) -> None:
    """Run each RECIPE's baseline and reference over seeds and say how early stabkit warned.

    Default: every built-in recipe. Per recipe: baseline runs reproduced, runs lost (a non-finite
    loss, or a held-out loss back at the bigram level for good), runs where a detector fired at or
    before that step, the median and worst lead time in steps, and detector events on the
    reference runs (false alarms). Writes OUT/lead_time.json, OUT/lead_time.md and each run's
    summary and TensorBoard logs under OUT/<recipe>/seed<k>/.
    """
    import torch

    from ..harness.recipes import list_recipe_files, preflight
    from ..harness.recipes.science.leadtime import format_table
    from ..harness.recipes.science.seeds import TABLE_JSON, run_label, run_seeds, seed_recipe
    from ..harness.recipes.spec.arch import RecipeNotApplicable

    names = list(recipes) or [p.stem for p in list_recipe_files()]
    spec = model_spec(model, model_option)
    loaded = []
    for name in names:
        try:
            recipe = seed_recipe(name, size, 0, steps, data, spec)
            preflight(recipe)
        except RecipeNotApplicable as exc:
            click.echo(f"skipped: {' '.join(str(exc).split())}")
            continue
        loaded.append(recipe)
    if not loaded:
        raise UserInputError(f"no recipe of {', '.join(names)} applies to {model}")
    for recipe in loaded:
        if not any(v.role == "baseline" for v in recipe.variants):
            raise UserInputError(f"recipe {recipe.name!r} has no baseline variant: nothing to time")
    dev = resolve_device(device)
    workers = resolve_jobs(jobs, dev)
    if dev == "cpu":
        torch.set_num_threads(1)
    out_dir = writable_dir(out or Path("runs") / "lead-time", "--out")
    click.echo(
        f"lead time over seeds 0..{seeds - 1} [{loaded[0].size}, {dev}, {workers} process(es)]: "
        + ", ".join(f"{r.name} ({r.train.steps} steps)" for r in loaded)
    )
    names_bars = [run_label(r.name, s, v.name) for r in loaded for s in range(seeds) for v in r.variants]
    bars = MultiProgress(names_bars, loaded[0].train.steps)
    try:
        report = run_seeds(
            [r.name for r in loaded],
            range(seeds),
            out_dir,
            size=size,
            steps=steps,
            data=data,
            model=spec,
            device=dev,
            workers=workers,
            on_progress=bars.update,
        )
    finally:
        bars.close()
    click.echo("")
    click.echo(format_table(report.rows))
    click.echo("")
    if report.reused:
        shown = (
            ", ".join(report.reused)
            if len(report.reused) <= 3
            else f"{len(report.reused)} (recipe, seed) runs"
        )
        click.echo(f"read back from an earlier sweep (judged again): {shown}")
    if report.incomplete:
        click.echo("PARTIAL: did not finish: " + ", ".join(report.incomplete))
    click.echo(f"table: {out_dir / TABLE_JSON}; view: tensorboard --logdir {out_dir}")
    if report.interrupted:
        sys.exit(130)
    if report.incomplete:
        sys.exit(1)
