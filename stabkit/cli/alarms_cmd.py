"""`stabkit alarms`: the alarm benchmark — false alarms on the healthy-run corpus, planted spikes found,
and lead times on the failing recipes, per detector kind."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from .app import UserInputError, main, writable_dir


@main.command(name="alarms")
@click.option(
    "--quick", is_flag=True, help="The CI subset: the ci-tagged configs × 100 steps, two recipes × 1 seed."
)
@click.option(
    "--configs", "pattern", default=None, help="Glob(s) over config names, comma-separated (default: all)."
)
@click.option(
    "--steps", type=click.IntRange(10, 100_000), default=None, help="Optimizer steps of every corpus run."
)
@click.option("--workers", type=click.IntRange(1, 64), default=2, show_default=True, help="Processes.")
@click.option(
    "--monitor",
    type=click.Choice(["config", "default", "full", "both"]),
    default="config",
    show_default=True,
    help="MonitorConfig of the healthy runs: each config's own, MonitorConfig(), .full(), or both.",
)
@click.option(
    "--recipes",
    default=None,
    help="Recipes whose baselines give the lead times, comma-separated; 'none' for none (default: all built-in).",
)
@click.option("--seeds", type=click.IntRange(1, 100), default=3, show_default=True, help="Seeds per recipe.")
@click.option(
    "--out", type=click.Path(file_okay=False), default=None, help="Output folder (default: runs/alarms)."
)
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON instead of the table.")
@click.option("--list", "list_only", is_flag=True, help="List the corpus and exit.")
def alarms_command(
    quick: bool,
    pattern: str | None,
    steps: int | None,
    workers: int,
    monitor: str,
    recipes: str | None,
    seeds: int,
    out: str | None,
    as_json: bool,
    list_only: bool,
) -> None:
    """Run the healthy-run corpus (and planted loss spikes) plus the recipes' baselines, and print per
    detector kind: false alarms (warnings on healthy runs, and per 1000 steps), notes, planted spikes
    found, lost runs warned in time, median and worst lead time. Progress goes to stderr; the table
    (or --json) to stdout; everything to OUT/alarms.json and OUT/alarms.md."""
    from ..harness.alarms.bench import full_plan, quick_plan, run_bench
    from ..harness.alarms.corpus import select

    configs = select(pattern)
    if not configs:
        raise UserInputError(
            f"--configs {pattern!r} matches no healthy config; `stabkit alarms --list` names them"
        )
    if list_only:
        for c in configs:
            click.echo(f"{c.name:28s} {c.describe()}")
        return
    names = _recipes(recipes)
    plan = quick_plan(workers) if quick else full_plan(pattern, steps, workers, names, seeds)
    if quick:
        if pattern is not None:
            plan.configs = [c for c in plan.configs if c in configs]
            plan.planted = [c for c in plan.planted if c in configs]
        plan.steps = steps or plan.steps
        if recipes is not None:
            plan.recipes = tuple(names)
    plan.monitors = {
        "config": (None,),
        "default": ("default",),
        "full": ("full",),
        "both": ("default", "full"),
    }[monitor]
    folder = writable_dir(out or Path("runs") / "alarms", "--out")
    healthy, planted = plan.jobs()
    click.echo(
        f"alarms: {len(healthy)} healthy + {len(planted)} planted corpus runs, recipes "
        f"{', '.join(plan.recipes) or 'none'} × {plan.seeds} seed(s), {plan.workers} process(es)",
        err=True,
    )
    start = time.monotonic()

    def progress(label: str, res: dict[str, Any]) -> None:
        warn = sum(e.get("severity") in ("warning", "critical") for e in res.get("events", []))
        err = f" ERROR {res['error']}" if res.get("error") else ""
        click.echo(
            f"[{time.monotonic() - start:5.0f}s] {label}: loss {res.get('first_loss', float('nan')):.2f} → "
            f"{res.get('last_loss', float('nan')):.2f}, {len(res.get('events', []))} events, {warn} warning(s){err}",
            err=True,
        )

    statuses: dict[str, str] = {}

    def recipe_progress(run: str, status: str, step: int, total: int, loss: float) -> None:
        if statuses.get(run) != status and status != "step":  # start, done, failed...: not every step
            statuses[run] = status
            click.echo(f"[{time.monotonic() - start:5.0f}s] {run}: {status} (step {step}/{total})", err=True)

    result = run_bench(plan, folder, on_result=progress, on_progress=recipe_progress)
    if as_json:
        click.echo(json.dumps({"rows": result.rows, "not_falling": result.not_falling}, indent=1))
    else:
        click.echo(result.table)
        if result.not_falling:
            click.echo(f"not healthy (loss did not fall, or failed): {', '.join(result.not_falling)}")
    click.echo(f"[{result.wall_s:.0f}s] wrote {folder / 'alarms.json'} and {folder / 'alarms.md'}", err=True)
    sys.stdout.flush()


def _recipes(text: str | None) -> list[str]:
    from ..harness.recipes import list_recipe_files

    known = [p.stem for p in list_recipe_files()]
    if text is None:
        return known
    if text.strip().lower() == "none":
        return []
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UserInputError(
            f"--recipes: unknown recipe(s) {', '.join(unknown)}; built-in: {', '.join(known)}"
        )
    return names
