"""`stabkit run RECIPE`: train the baseline and each intervention side by side, then say whether
the instability was reproduced and which interventions fixed it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click
import torch

from ..models import PRESETS
from .app import UserInputError, main
from .progress import MultiProgress


def resolve_device(device: str) -> str:
    """auto -> cuda when available, else cpu; cuda without a GPU is a user error."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserInputError("--device cuda: no CUDA device is available (use --device cpu)")
    return device


def resolve_jobs(jobs: int | None, device: str) -> int:
    """Default: two processes on a CPU (at most the core count), one on a GPU."""
    if jobs is not None:
        return jobs
    return 1 if device == "cuda" else max(1, min(2, os.cpu_count() or 1))


def shared_options(fn: click.decorators.FC) -> click.decorators.FC:
    """Options `run` and `sweep` share."""
    for opt in reversed(
        [
            click.option(
                "--size",
                type=click.Choice(list(PRESETS)),
                default=None,
                help="Model size preset (default: the recipe's, else tiny).",
            ),
            click.option(
                "--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True
            ),
            click.option(
                "--steps",
                type=click.IntRange(1, 10_000_000),
                default=None,
                help="Override the recipe's steps (a shortened run; fault steps scale).",
            ),
            click.option(
                "--seed",
                type=click.IntRange(0),
                default=None,
                help="Seed of init and data order (default: the recipe's).",
            ),
            click.option(
                "--jobs",
                type=click.IntRange(1, 256),
                default=None,
                help="Parallel processes (default: min(2, cores) on CPU, 1 on CUDA).",
            ),
            click.option(
                "--data",
                type=click.Path(exists=True, dir_okay=False),
                default=None,
                help="Train on this text file instead of the embedded text.",
            ),
        ]
    ):
        fn = opt(fn)
    return fn


def header(recipe: object, device: str, jobs: int, original_steps: int | None) -> str:
    """One paragraph on what is about to run."""
    from ..recipes import Recipe

    assert isinstance(recipe, Recipe)
    lines = [
        f"{recipe.name} [{recipe.size}, {device}, seed {recipe.train.seed}, {recipe.train.steps} steps, {jobs} process(es)]"
    ]
    if recipe.description:
        lines.append(f"  {recipe.description}")
    expect = recipe.sizes.get(recipe.size, {}).get("expect")
    lines.append(
        f"  expected at this size: {expect}"
        if expect
        else f"  no [sizes.{recipe.size}] table: the recipe's base values are used"
    )
    if original_steps is not None and original_steps != recipe.train.steps:
        lines.append(
            f"  shortened run ({recipe.train.steps} of {original_steps} steps): verdicts are about this run only"
        )
    lines.append("  variants: " + ", ".join(f"{v.name} ({v.role})" for v in recipe.variants))
    return "\n".join(lines)


@main.command(name="run")
@click.argument("recipe")
@shared_options
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="Output folder (default: runs/<recipe name>).",
)
def run_command(
    recipe: str,
    size: str | None,
    device: str,
    steps: int | None,
    seed: int | None,
    jobs: int | None,
    data: str | None,
    out: str | None,
) -> None:
    """Train RECIPE's baseline and variants side by side (a path, or a name from `stabkit list recipes`).

    Prints a results table and a verdict per variant, writes TensorBoard logs (one folder per
    variant) and OUT/summary.json (rewritten after each variant; "complete": false until the end).
    """
    from ..recipes import load_recipe, preflight, run_recipe
    from ..recipes.report import footer, results_table, verdict_lines

    loaded = load_recipe(recipe, size, steps=steps, seed=seed, data=data)
    original = load_recipe(recipe, size).train.steps if steps is not None else None
    preflight(loaded)
    dev = resolve_device(device)
    workers = resolve_jobs(jobs, dev)
    if dev == "cpu":
        torch.set_num_threads(1)
    out_dir = Path(out or Path("runs") / loaded.name)
    click.echo(header(loaded, dev, workers, original))
    bars = MultiProgress([v.name for v in loaded.variants], loaded.train.steps)
    try:
        summary = run_recipe(loaded, out_dir, device=dev, workers=workers, on_progress=bars.update)
    finally:
        bars.close()
    notes = sorted({n for r in summary["variants"].values() for n in r.get("notes", [])})
    click.echo("")
    click.echo(results_table(summary))
    click.echo("")
    click.echo(verdict_lines(summary))
    click.echo("")
    for note in notes:
        click.echo(f"note: {note}")
    click.echo(footer(summary))
    click.echo(
        f"took {summary.get('seconds', 0):.0f} s; summary: {out_dir / 'summary.json'}; view: tensorboard --logdir {out_dir}"
    )
    if summary["interrupted"]:
        sys.exit(130)
    if not summary["complete"]:
        sys.exit(1)
