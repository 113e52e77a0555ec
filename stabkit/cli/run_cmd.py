"""`stabkit run RECIPE`: train the baseline and each intervention side by side, then say whether
the instability was reproduced and which interventions fixed it.

With ``--nproc N`` (N > 1) the command relaunches itself under torchrun on N local processes;
each rank then runs the same command as one rank of a data-parallel run (the launching lives in
`stabkit.harness.launch`; this module parses, calls and prints).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..harness.models.presets import PRESETS
from .app import UserInputError, main, writable_dir
from .progress import MultiProgress

if TYPE_CHECKING:
    from ..harness.launch import Relaunched
    from ..harness.models.spec import ModelSpec
    from ..harness.recipes import Recipe
    from ..harness.recipes.results.summary import Summary


def resolve_device(device: str) -> str:
    """auto -> cuda when available, else cpu; cuda without a GPU is a user error."""
    import torch

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


SHARED_OPTIONS = {
    "model": click.option(
        "--model",
        "model",
        default=None,
        metavar="SPEC",
        help="The model to stress: a preset (tiny, small, gpt2, 1b: the reference GPT), hf:<model_type> "
        "(any causal LM of the installed transformers, built from its config at the recipe's size, no "
        "download) or module:callable (your factory; file.py:callable works too). Default: the "
        "recipe's [model], else the reference GPT.",
    ),
    "model_option": click.option(
        "--model-option",
        "model_option",
        multiple=True,
        metavar="KEY=VALUE",
        help="A config field of an hf: model (num_local_experts=4) or a keyword argument of your "
        "factory; repeatable.",
    ),
    "size": click.option(
        "--size",
        type=click.Choice(list(PRESETS)),
        default=None,
        help="Model size preset (default: the recipe's, else tiny); with --model hf:/module: the "
        "size that model is built at.",
    ),
    "device": click.option(
        "--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True
    ),
    "steps": click.option(
        "--steps",
        type=click.IntRange(1, 10_000_000),
        default=None,
        help="Override the recipe's steps (shorter: fault step and warmup scale down; longer: they stay).",
    ),
    "seed": click.option(
        "--seed",
        type=click.IntRange(0),
        default=None,
        help="Seed of init and data order (default: the recipe's).",
    ),
    "jobs": click.option(
        "--jobs",
        type=click.IntRange(1, 256),
        default=None,
        help="Parallel processes (default: min(2, cores) on CPU, 1 on CUDA).",
    ),
    "data": click.option(
        "--data",
        type=click.Path(exists=True, dir_okay=False),
        default=None,
        help="Train on this text file instead of the embedded text.",
    ),
}
"""The options of the commands that train recipes, by name, in the order --help lists them."""


def with_options(*names: str) -> Callable[[click.decorators.FC], click.decorators.FC]:
    """A decorator adding the `SHARED_OPTIONS` named (in their table order)."""

    def add(fn: click.decorators.FC) -> click.decorators.FC:
        for name in reversed([n for n in SHARED_OPTIONS if n in names]):
            fn = SHARED_OPTIONS[name](fn)
        return fn

    return add


shared_options = with_options(*SHARED_OPTIONS)
"""Options `run` and `sweep` share: all of them."""


def model_spec(model: str | None, options: tuple[str, ...]) -> ModelSpec | None:
    """--model and --model-option as a ModelSpec (None without --model); bad input exits 2."""
    from ..harness.models.spec import parse_model_spec, parse_options

    if model is None:
        if options:
            raise UserInputError("--model-option needs --model (an hf:<model_type> or module:callable spec)")
        return None
    return parse_model_spec(model, parse_options(options))


def not_applicable(exc: Exception) -> None:
    """A recipe whose trigger this model cannot take: one line, exit 0 (nothing failed, nothing ran)."""
    click.echo(f"skipped: {' '.join(str(exc).split())}")
    sys.exit(0)


def load_to_train(
    recipe: str,
    size: str | None,
    steps: int | None,
    seed: int | None,
    data: str | None,
    model: str | None,
    model_option: tuple[str, ...],
) -> tuple[Recipe, int | None]:
    """`run` and `sweep`: the recipe loaded with the command's overrides and checked (`preflight`), and
    its own step count when --steps changed it. A recipe the model cannot take ends the command here
    (`not_applicable`)."""
    from ..harness.recipes import load_recipe, preflight
    from ..harness.recipes.spec.arch import RecipeNotApplicable

    spec = model_spec(model, model_option)
    try:
        loaded = load_recipe(recipe, size, steps=steps, seed=seed, data=data, model=spec)
        preflight(loaded)
    except RecipeNotApplicable as exc:
        not_applicable(exc)
    original = load_recipe(recipe, loaded.size).train.steps if steps is not None else None
    return loaded, original


def steps_note(steps: int, original: int) -> str:
    """`shortened run (20 of 300 steps)` or `lengthened run (600 steps; the recipe has 300)`."""
    if steps < original:
        return f"shortened run ({steps} of {original} steps)"
    return f"lengthened run ({steps} steps; the recipe has {original})"


def header(recipe: object, device: str, jobs: int, original_steps: int | None, ddp: int = 0) -> str:
    """One paragraph on what is about to run (`ddp`: processes per variant, when data-parallel)."""
    from ..harness.recipes import Recipe

    assert isinstance(recipe, Recipe)
    procs = (
        f"DDP over {ddp} processes ({'nccl' if device.startswith('cuda') else 'gloo'})"
        if ddp > 1
        else f"{jobs} process(es)"
    )
    model = f"{recipe.arch.describe()} at {recipe.size}" if recipe.arch is not None else recipe.size
    lines = [
        f"{recipe.name} [{model}, {device}, seed {recipe.train.seed}, {recipe.train.steps} steps, {procs}]"
    ]
    if recipe.description:
        lines.append(f"  {recipe.description}")
    expect = recipe.sizes.get(recipe.size, {}).get("expect")
    where = "on the reference GPT at this size" if recipe.arch is not None else "at this size"
    lines.append(
        f"  expected {where}: {expect}"
        if expect
        else f"  no [sizes.{recipe.size}] table: the recipe's base values are used"
    )
    if original_steps is not None and original_steps != recipe.train.steps:
        lines.append(f"  {steps_note(recipe.train.steps, original_steps)}: verdicts are about this run only")
    lines.append("  variants: " + ", ".join(f"{v.name} ({v.role})" for v in recipe.variants))
    if recipe.adaptation is not None:
        lines += [f"  skipped {name}: {why}" for name, why in recipe.adaptation.skipped.items()]
        lines += [f"  note: {note}" for note in recipe.adaptation.notes]
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
@click.option(
    "--nproc",
    type=click.IntRange(1, 1024),
    default=None,
    help="Processes per variant: N > 1 trains each variant with DDP on N local processes under "
    "torchrun (gloo on CPU, NCCL on CUDA), variants one after another. Default 1.",
)
def run_command(
    recipe: str,
    model: str | None,
    model_option: tuple[str, ...],
    size: str | None,
    device: str,
    steps: int | None,
    seed: int | None,
    jobs: int | None,
    data: str | None,
    out: str | None,
    nproc: int | None,
) -> None:
    """Train RECIPE's baseline and variants side by side (a path, or a name from `stabkit list recipes`).

    Prints a results table and a verdict per variant, writes TensorBoard logs (one folder per
    variant) and OUT/summary.json (rewritten after each variant; "complete": false until the end).
    """
    import torch

    from ..distributed import launched_by_torchrun
    from ..harness.launch import relaunch
    from ..harness.recipes import run_recipe
    from ..harness.recipes.run.ddp import check_split

    world = int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun() else 1
    if world > 1 and nproc not in (None, world):
        raise UserInputError(f"--nproc {nproc}: torchrun already started {world} processes; drop --nproc")
    procs = world if world > 1 else nproc or 1
    if procs > 1 and jobs is not None and jobs > 1:
        raise UserInputError(
            f"--nproc {procs} trains each variant on {procs} processes, one variant after another; "
            f"it cannot be combined with --jobs {jobs} (drop --jobs)"
        )
    loaded, original = load_to_train(recipe, size, steps, seed, data, model, model_option)
    dev = resolve_device(device)
    out_dir = writable_dir(out or Path("runs") / loaded.name, "--out")
    if procs > 1:
        check_split(loaded, procs)
        if world > 1:
            sys.exit(run_as_rank(loaded, dev, out_dir, original))
        if dev == "cuda" and procs > torch.cuda.device_count():
            raise UserInputError(f"--nproc {procs}: only {torch.cuda.device_count()} CUDA device(s) here")
        args = ["run", recipe, "--device", dev, "--out", str(out_dir)]
        for flag, value in (
            ("--size", size), ("--steps", steps), ("--seed", seed), ("--data", data), ("--model", model)
        ):  # fmt: skip
            args += [flag, str(value)] if value is not None else []
        for item in model_option:
            args += ["--model-option", item]
        sys.exit(relaunched_exit_code(relaunch(procs, args, out_dir)))
    workers = resolve_jobs(jobs, dev)
    if dev == "cpu":
        torch.set_num_threads(1)
    click.echo(header(loaded, dev, workers, original))
    bars = MultiProgress([v.name for v in loaded.variants], loaded.train.steps)
    try:
        summary = run_recipe(loaded, out_dir, device=dev, workers=workers, on_progress=bars.update)
    finally:
        bars.close()
    print_results(summary, out_dir)
    sys.exit(exit_code(summary))


def run_as_rank(recipe: object, device: str, out_dir: Path, original: int | None) -> int:
    """One rank of a data-parallel run (under torchrun): every variant with DDP on all ranks; rank 0
    shows progress and prints the results. Returns the exit code (0 when `stabkit run --nproc`
    started this rank: its parent reports)."""
    from ..harness.launch import rank_device, rank_group, rank_should_stop, relaunched
    from ..harness.recipes import Recipe, run_recipe

    assert isinstance(recipe, Recipe)
    device = rank_device(device)
    with rank_group(device) as ctx:
        should_stop = rank_should_stop()
        bars = MultiProgress([v.name for v in recipe.variants], recipe.train.steps) if ctx.writes else None
        if ctx.writes:
            click.echo(header(recipe, device, 1, original, ddp=ctx.world_size))
        try:
            summary = run_recipe(
                recipe,
                out_dir,
                device=device,
                dist=ctx,
                on_progress=bars.update if bars else None,
                should_stop=should_stop,
            )
        finally:
            if bars is not None:
                bars.close()
        if ctx.writes:
            print_results(summary, out_dir)
    return 0 if relaunched() else exit_code(summary)


def relaunched_exit_code(outcome: Relaunched) -> int:
    """The exit code of `stabkit run --nproc N`: 130 / 143 when stopped by Ctrl-C / SIGTERM,
    torchrun's code (or 1) when it failed or left no summary, else the summary's."""
    if outcome.stopped_by is not None:
        return 143 if outcome.stopped_by == "SIGTERM" else 130
    if outcome.returncode != 0 or outcome.summary is None:
        return outcome.returncode or 1
    return exit_code(outcome.summary)


def print_results(summary: Summary, out_dir: Path) -> None:
    """The results table, the verdicts, notes and where the logs are."""
    from ..harness.recipes.results.report import footer, results_legend, results_table, verdict_lines

    notes = sorted({n for r in summary.variants.values() for n in r.get("notes", [])})
    click.echo("")
    click.echo(results_table(summary))
    click.echo(results_legend(summary))
    click.echo("")
    click.echo(verdict_lines(summary))
    click.echo("")
    for note in notes:
        click.echo(f"note: {note}")
    for name, why in ((summary.arch or {}).get("skipped") or {}).items():
        click.echo(f"skipped {name}: {why}")
    click.echo(footer(summary))
    click.echo(
        f"took {summary.seconds or 0:.0f} s; summary: {out_dir / 'summary.json'}; view: tensorboard --logdir {out_dir}"
    )


def exit_code(summary: Summary) -> int:
    """143 when stopped by SIGTERM, 130 when interrupted (Ctrl-C), 1 when some variant did not
    finish, else 0."""
    if summary.interrupted:
        return 143 if summary.stopped_by == "SIGTERM" else 130
    return 0 if summary.complete else 1
