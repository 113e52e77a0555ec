"""`stabkit scale RECIPE`: fit how the max attention logit grows with LR and width on small models,
predict the LR at which a wider one crosses 1e4, and check the prediction on a wider run."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import click

from .app import UserInputError, main, writable_dir
from .progress import MultiProgress
from .run_cmd import resolve_device, resolve_jobs, with_options
from .sweep_cmd import parse_lrs


def parse_widths(text: str | None, option: str) -> list[int]:
    """'32,64 128' -> [32, 64, 128]; each a positive integer."""
    if not text:
        return []
    items = [t for t in text.replace(",", " ").split() if t]
    try:
        values = sorted({int(t) for t in items})
    except ValueError:
        raise UserInputError(
            f"{option} must be positive integers separated by commas, got {text!r}"
        ) from None
    if any(v < 1 for v in values):
        raise UserInputError(f"{option} must be positive integers separated by commas, got {text!r}")
    return values


def fmt_lr(lr: float | None) -> str:
    return "none" if lr is None or not math.isfinite(lr) else f"{lr:.3g}"


@main.command(name="scale")
@click.argument("recipe", default="attention-logit-growth")
@click.option(
    "--widths", default="32,64,128", show_default=True, help="Widths (d_model) the law is fitted on."
)
@click.option(
    "--check",
    "check_width",
    type=click.IntRange(0),
    default=256,
    show_default=True,
    help="A wider model to predict and then run (baseline only) to measure the error; 0: none.",
)
@click.option(
    "--predict", "predict_widths", default="", help="More widths to predict (not run), e.g. 1024,4096."
)
@click.option(
    "--lrs", default=None, help="Peak LRs (default: the recipe's grid within its high end, 1e-2..3e-1)."
)
@click.option(
    "--variants", default=None, help="Variants to sweep (default: the baseline and its qk_norm variants)."
)
@click.option(
    "--threshold",
    type=float,
    default=1e4,
    show_default=True,
    help="Max attention logit that counts as divergence.",
)
@with_options("size", "device", "steps", "seed", "jobs")
@click.option(
    "--out",
    type=click.Path(file_okay=False),
    default=None,
    help="Output folder (default: runs/<recipe>-scale); finished runs there are reused.",
)
def scale_command(
    recipe: str,
    widths: str,
    check_width: int,
    predict_widths: str,
    lrs: str | None,
    variants: str | None,
    threshold: float,
    size: str | None,
    device: str,
    steps: int | None,
    seed: int | None,
    jobs: int | None,
    out: str | None,
) -> None:
    """Predict from small widths where a wider model's attention logits cross the threshold.

    Trains RECIPE's baseline and qk_norm variants at every (width, LR), fits
    log10 max_logit = a + b·log10 LR + c·log10 width + d·log10 LR·log10 width on the runs in the
    growth regime, extrapolates the LR at which --check (and --predict) widths cross --threshold with
    a 90 % interval, then runs the --check width and reports the error. Writes OUT/scale.json and
    OUT/scale.png (with the `plot` extra).
    """
    import torch

    from ..harness.recipes import load_recipe, preflight
    from ..harness.recipes.science.widths import (
        SCALE,
        at_width,
        planned_runs,
        run_key,
        run_widths,
        scaled_variants,
    )

    fit_widths = parse_widths(widths, "--widths")
    if len(fit_widths) < 2:
        raise UserInputError(f"--widths needs at least two widths to fit a law over width, got {widths!r}")
    extra = parse_widths(predict_widths, "--predict")
    if not (threshold > 1 and math.isfinite(threshold)):
        raise UserInputError(f"--threshold must be a number above 1, got {threshold!r}")
    loaded = load_recipe(recipe, size, steps=steps, seed=seed)
    preflight(loaded)
    try:
        names = [n.strip() for n in variants.split(",") if n.strip()] if variants else None
        swept = scaled_variants(loaded, names)
        for w in [*fit_widths, *([check_width] if check_width else []), *extra]:
            at_width(loaded, w)
    except ValueError as exc:
        raise UserInputError(str(exc)) from None
    lo, hi = loaded.sweep.high
    grid = parse_lrs(lrs) or [lr for lr in loaded.sweep.lrs if lo <= lr <= hi]
    dev = resolve_device(device)
    workers = resolve_jobs(jobs, dev)
    if dev == "cpu":
        torch.set_num_threads(1)
    out_dir = writable_dir(out or Path("runs") / f"{loaded.name}-scale", "--out")
    click.echo(
        f"{loaded.name} [{loaded.size}, {dev}, {loaded.train.steps} steps, {workers} process(es)]: widths "
        f"{', '.join(map(str, fit_widths))}; check d{check_width or '-'}; variants "
        f"{', '.join(v.name for v in swept)}; LRs {', '.join(f'{lr:g}' for lr in grid)}"
    )
    runs = planned_runs(fit_widths, check_width or None, [v.name for v in swept], grid)
    bars = MultiProgress([run_key(*run) for run in runs], loaded.train.steps)
    try:
        report = run_widths(
            loaded,
            out_dir,
            widths=fit_widths,
            lrs=grid,
            check_width=check_width or None,
            predict_widths=extra,
            variants=[v.name for v in swept],
            threshold=threshold,
            device=dev,
            workers=workers,
            on_progress=bars.update,
        )
    finally:
        bars.close()
    click.echo("")
    click.echo(scale_lines(report))
    click.echo(f"plot: {report.plot}")
    click.echo(f"took {report.seconds or 0:.0f} s; results: {out_dir / SCALE}")
    if report.interrupted:
        sys.exit(130)
    if not report.complete:
        sys.exit(1)


def scale_lines(report: object) -> str:
    """The measured crossings per width and variant, the law, the predictions and the check."""
    from ..harness.recipes.science.widths import ScaleReport

    assert isinstance(report, ScaleReport)
    lines = []
    for variant, entry in report.fits.items():
        measured = ", ".join(f"d{w} {fmt_lr(lr)}" for w, lr in entry.get("measured", {}).items())
        lines.append(f"{variant}: LR where the max logit crosses {report.threshold:g}, measured: {measured}")
        law = entry.get("law", {})
        if "error" in law:
            top = max((r.get("max_attn_logit") or 0.0 for r in report.runs.values() if r["variant"] == variant),
                      default=0.0)  # fmt: skip
            lines.append(f"  no law fitted (max logit on the grid {top:.3g}): {law['error']}")
            continue
        a, b, c, d = law["params"]
        lines.append(
            f"  law: log10 z = {a:.2f} + {b:.2f}·x + {c:.2f}·u + {d:.2f}·x·u (x = log10 LR, u = log10 width; "
            f"{law['points']} runs, residual {law['residual_std']:.2f} decades)"
        )
        for w, p in entry.get("predictions", {}).items():
            lines.append(
                f"  predicted d{w}: {fmt_lr(p['lr'])} (90 %: {fmt_lr(p['low'])}..{fmt_lr(p['high'])}"
                + (f"; {p['no_crossing']:.0%} of draws never cross" if p["no_crossing"] > 0 else "")
                + ")"
            )
    if report.check:
        c = report.check
        if c["error_decades"] is None:
            lines.append(f"check d{c['prediction']['width']}: {'; '.join(c['notes'])}")
        else:
            lines.append(
                f"check d{c['prediction']['width']}: predicted {fmt_lr(c['prediction']['lr'])}, measured "
                f"{fmt_lr(c['measured'])}: error {c['error_decades']:+.2f} decades (x{10 ** abs(c['error_decades']):.2f}); "
                f"{'inside' if c['inside_interval'] else 'outside'} the 90 % interval"
            )
    return "\n".join(lines)
