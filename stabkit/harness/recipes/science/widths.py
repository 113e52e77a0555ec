"""The width sweep behind `stabkit scale`: a recipe's baseline (and its qk_norm variant) at every
(width, peak LR), the law of `stabkit.harness.recipes.scaling` fitted on the small widths, and the
prediction checked on a wider model that the fit did not see.

Runs in the CLI's process; the runs go to the pool (``<out>/d<width>/<variant>/lr_<lr>``).
``<out>/scale.json`` is rewritten after every run; runs already done there with the same settings
are read back, so an interrupted sweep resumes. Only the baseline trains at the check width (it
answers the question; the wide runs are the expensive ones).
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..results.run_result import RunResult
from ..run.job import Job, Progress
from ..run.pool import execute
from ..run.runner import clear_previous_logs, history_checks, write_json
from ..run.signals import SigtermStop
from ..spec.recipe import Recipe, VariantSpec
from .scaling import (
    THRESHOLD,
    LawFit,
    Point,
    Prediction,
    check,
    fit_law,
    measured_crossing,
    parameter_draws,
    predict,
)

SCALE = "scale.json"
PLOT = "scale.png"


def at_width(recipe: Recipe, width: int) -> Recipe:
    """A copy of `recipe` whose model has `width` (d_model); heads stay, head_dim follows.
    ValueError when the recipe's heads do not divide `width`."""
    wide = copy.deepcopy(recipe)
    try:
        wide.model = recipe.model.updated(d_model=width)
    except ValueError as exc:
        raise ValueError(f"width {width}: {exc}") from None
    return wide


def scaled_variants(recipe: Recipe, names: Sequence[str] | None = None) -> list[VariantSpec]:
    """The variants swept: `names` when given, else the baseline and every variant whose
    interventions include qk_norm (the comparison of Wortsman et al. Fig. 9)."""
    if names:
        known = {v.name: v for v in recipe.variants}
        missing = [n for n in names if n not in known]
        if missing:
            raise ValueError(f"no variant {missing[0]!r} in recipe {recipe.name!r}; it has {sorted(known)}")
        return [known[n] for n in names]
    chosen = [v for v in recipe.variants if v.role == "baseline" or "qk_norm" in v.interventions]
    if not any(v.role == "baseline" for v in chosen):
        raise ValueError(f"recipe {recipe.name!r} has no baseline variant to scale")
    return chosen


def run_key(width: int, variant: str, lr: float) -> str:
    return f"d{width}/{variant}/lr_{lr:.0e}"


def planned_runs(
    widths: Sequence[int], check_width: int | None, variants: Sequence[str], lrs: Sequence[float]
) -> list[tuple[int, str, float]]:
    """(width, variant, LR) of every run of the sweep, in training order: every variant at the
    fitted widths, the first (the baseline) only at the check width."""
    runs: list[tuple[int, str, float]] = []
    for width in [*widths, *([check_width] if check_width and check_width not in widths else [])]:
        for variant in variants if width in widths else variants[:1]:
            runs.extend((width, variant, lr) for lr in lrs)
    return runs


@dataclass
class ScaleReport:
    """The sweep's runs, the law per variant, predictions, and the check."""

    recipe: str
    size: str
    steps: int
    seed: int
    widths: list[int]
    check_width: int | None
    lrs: list[float]
    threshold: float
    variants: list[str]
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """run_key -> width, variant, lr, status, max_attn_logit, val_loss, logdir."""
    fits: dict[str, dict[str, Any]] = field(default_factory=dict)
    """variant -> {"law": LawFit dict | "error", "measured": {width: LR | None}, "predictions": {...}}."""
    check: dict[str, Any] | None = None
    complete: bool = False
    interrupted: bool = False
    seconds: float | None = None
    plot: str | None = None

    @property
    def all_widths(self) -> list[int]:
        """The fitted widths, then the check width (when there is one)."""
        return [*self.widths, *([self.check_width] if self.check_width else [])]

    def same_settings(self, other: dict[str, Any]) -> bool:
        keys = ("recipe", "size", "steps", "seed")
        return all(other.get(k) == getattr(self, k) for k in keys)

    def points(self, variant: str, widths: Sequence[int]) -> list[Point]:
        return [
            Point(int(r["width"]), float(r["lr"]), float(r.get("max_attn_logit", math.nan)))
            for r in self.runs.values()
            if r["variant"] == variant and r["width"] in widths and r.get("status") == "done"
        ]

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def refit(report: ScaleReport, predict_widths: Sequence[int] = ()) -> None:
    """Fit the law per variant on the fitted widths; predict at the check width and `predict_widths`;
    compare with the check width's measured crossing (baseline)."""
    report.fits = {}
    for variant in report.variants:
        entry: dict[str, Any] = {"measured": {}}
        for width in report.all_widths:
            curve = [(p.lr, p.max_logit) for p in report.points(variant, [width])]
            if curve:
                entry["measured"][str(width)] = measured_crossing(curve, report.threshold)
        targets = sorted({*predict_widths, *([report.check_width] if report.check_width else [])})
        try:
            law = fit_law(report.points(variant, report.widths), report.threshold)
            entry["predictions"] = {str(w): predict(law, w).to_dict() for w in targets}
            entry["law"] = law.to_dict()
        except ValueError as exc:  # too few runs in the growth regime: said in the error
            entry["law"] = {"error": str(exc)}
        except Exception as exc:  # a degenerate fit must never lose the runs it is computed from
            entry.pop("predictions", None)
            entry["law"] = {"error": f"the fit failed ({type(exc).__name__}: {exc})"}
        report.fits[variant] = entry
    base = report.variants[0]
    fit = report.fits.get(base, {})
    if report.check_width and "predictions" in fit:
        wide = report.points(base, [report.check_width])
        if wide:
            pred = Prediction(**fit["predictions"][str(report.check_width)])
            measured = measured_crossing([(p.lr, p.max_logit) for p in wide], report.threshold)
            report.check = {"variant": base, **check(pred, measured).to_dict()}


def run_widths(
    recipe: Recipe,
    out: str | Path,
    *,
    widths: Sequence[int],
    lrs: Sequence[float],
    check_width: int | None = None,
    predict_widths: Sequence[int] = (),
    variants: Sequence[str] | None = None,
    threshold: float = THRESHOLD,
    device: str = "cpu",
    workers: int = 1,
    on_progress: Progress | None = None,
    on_update: Callable[[ScaleReport], None] | None = None,
) -> ScaleReport:
    """Train the chosen variants at every (width, LR), fit, predict, check; see the module docstring."""
    out = Path(out)
    swept = scaled_variants(recipe, variants)
    report = ScaleReport(
        recipe=recipe.name,
        size=recipe.size,
        steps=recipe.train.steps,
        seed=recipe.train.seed,
        widths=sorted(widths),
        check_width=check_width,
        lrs=sorted(lrs),
        threshold=threshold,
        variants=[v.name for v in swept],
    )
    earlier = read_earlier(out / SCALE, report)
    checks = history_checks(recipe)
    jobs: list[Job] = []
    recipes = {w: at_width(recipe, w) for w in report.all_widths}
    for width, variant, lr in planned_runs(report.widths, check_width, report.variants, report.lrs):
        key = run_key(width, variant, lr)
        if key in earlier:
            report.runs[key] = earlier[key]
            continue
        jobs.append(
            Job(recipes[width], variant, str(out / key), device, lr=lr, run=key, history_checks=checks)
        )
    clear_previous_logs(jobs)
    started = time.perf_counter()

    def save() -> None:
        refit(report, predict_widths)
        report.seconds = time.perf_counter() - started
        write_json(out / SCALE, report.to_dict())

    def on_result(job: Job, result: RunResult) -> None:
        report.runs[job.run] = {
            "width": job.recipe.model.d_model,
            "variant": job.variant,
            "lr": job.lr,
            **result.pick(("status", "max_attn_logit", "val_loss", "diverged", "logdir")),
        }
        save()
        if on_update is not None:
            on_update(report)

    save()
    with SigtermStop() as term:
        report.interrupted = execute(jobs, workers, on_progress, on_result, term) or term.hit
    report.complete = not report.interrupted and all(r.get("status") == "done" for r in report.runs.values())
    save()
    report.plot = plot(report, out / PLOT)
    write_json(out / SCALE, report.to_dict())
    return report


def read_earlier(path: Path, report: ScaleReport) -> dict[str, dict[str, Any]]:
    """Finished runs of an earlier sweep in the same folder with the same settings."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or not report.same_settings(data):
        return {}
    return {k: r for k, r in data.get("runs", {}).items() if r.get("status") == "done"}


def plot(report: ScaleReport, path: Path) -> str:
    """Left: max attention logit vs LR per width (solid: baseline, dashed: the other variants; the
    law's lines; the check width predicted with its band, and measured). Right: the crossing LR vs
    width, measured and predicted with its interval. Returns the path, or why there is none."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import numpy as np
    except ImportError:
        return "skipped: matplotlib is not installed (pip install 'stabkit[plot]')"
    fig, (ax, ax_cross) = plt.subplots(1, 2, figsize=(12, 4.5))
    widths = report.all_widths
    colors = {w: plt.get_cmap("viridis")(i / max(1, len(widths) - 1)) for i, w in enumerate(widths)}
    grid = np.geomspace(min(report.lrs), max(report.lrs), 50)
    for k, variant in enumerate(report.variants):
        style = "-" if k == 0 else "--"
        law = report.fits.get(variant, {}).get("law", {})
        fit = LawFit(**law) if "params" in law else None
        for width in widths:
            pts = sorted((p.lr, p.max_logit) for p in report.points(variant, [width]))
            if not pts:
                continue
            label = f"d{width} {variant}" + (" (check)" if width == report.check_width else "")
            marker = "*" if width == report.check_width else "o"
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker=marker,
                linestyle=style,
                color=colors[width],
                label=label,
                alpha=0.9,
            )
            if fit is not None and width in report.widths:
                ax.plot(
                    grid,
                    [10 ** fit.log_logit(width, lr) for lr in grid],
                    linestyle=":",
                    color=colors[width],
                    linewidth=1,
                )
        if fit is not None and k == 0 and report.check_width:
            band = law_band(fit, report.check_width, grid)
            ax.fill_between(
                grid,
                band[0],
                band[2],
                color=colors[report.check_width],
                alpha=0.2,
                label=f"d{report.check_width} predicted (90 %)",
            )
            ax.plot(grid, band[1], color=colors[report.check_width], linestyle=":", linewidth=1)
    ax.axhline(report.threshold, color="red", linestyle=":", label=f"threshold {report.threshold:g}")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="peak learning rate",
        ylabel="max attention logit",
        title=f"{report.recipe}: max logit vs LR per width",
    )
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    plot_crossings(ax_cross, report)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def law_band(fit: LawFit, width: int, grid: Any) -> tuple[list[float], list[float], list[float]]:
    """5th, 50th, 95th percentile of the law's max logit at `width` over parameter draws."""
    import numpy as np

    draws = parameter_draws(fit, 1000)
    x, u = np.log10(grid), math.log10(width)
    curves = draws[:, :1] + draws[:, 1:2] * x + draws[:, 2:3] * u + draws[:, 3:4] * x * u
    lo, mid, hi = np.quantile(curves, [0.05, 0.5, 0.95], axis=0)
    return list(10**lo), list(10**mid), list(10**hi)


def plot_crossings(ax: Any, report: ScaleReport) -> None:
    """The crossing LR vs width: measured per width, the law (and its interval) over widths."""
    import numpy as np

    base = report.variants[0]
    entry = report.fits.get(base, {})
    measured = {int(w): lr for w, lr in entry.get("measured", {}).items() if lr is not None}
    if measured:
        ws = sorted(measured)
        ax.plot(ws, [measured[w] for w in ws], "o", color="black", label=f"measured ({base})")
    law = entry.get("law", {})
    if "params" in law:
        fit = LawFit(**law)
        top = max(report.all_widths) * 2
        span = np.geomspace(min(report.widths) / 1.5, top, 30)
        preds = [predict(fit, int(w), draws=400) for w in span]
        ax.plot(span, [p.lr or math.nan for p in preds], color="C0", label="law")
        ax.fill_between(
            span,
            [p.low or math.nan for p in preds],
            [p.high or math.nan for p in preds],
            color="C0",
            alpha=0.2,
            label="90 % interval",
        )
    if report.check:
        pred = report.check["prediction"]
        if pred["lr"] is not None and pred["low"] is not None:
            ax.errorbar(
                [pred["width"]],
                [pred["lr"]],
                yerr=[[pred["lr"] - pred["low"]], [pred["high"] - pred["lr"]]],
                fmt="s",
                color="C1",
                capsize=4,
                label=f"predicted d{pred['width']}",
            )
        if report.check["measured"] is not None:
            ax.plot(
                [pred["width"]],
                [report.check["measured"]],
                "*",
                color="red",
                markersize=12,
                label=f"measured d{pred['width']}",
            )
    ticks = sorted(set(report.all_widths))
    ax.set_xscale("log")
    ax.set_xticks(ticks, [str(w) for w in ticks])
    ax.minorticks_off()
    ax.set(
        yscale="log",
        xlabel="width (d_model)",
        ylabel=f"LR where max logit crosses {report.threshold:g}",
        title="predicted vs measured",
    )
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
