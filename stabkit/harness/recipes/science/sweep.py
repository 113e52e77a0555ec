"""LR sweep and LR sensitivity (Wortsman et al. 2023 §2.2): every variant at every peak LR of a grid.

LR sensitivity of a variant over an LR range [a, b] of the grid:

    E_{η ∈ grid ∩ [a, b]} [ min(ℓ(η), ℓ₀) − ℓ* ]

- ℓ(η): the held-out loss at the end of the run with peak LR η (non-finite counts as ℓ₀);
- ℓ₀: the held-out loss at initialization (the same batches, before the first step);
- ℓ*: the best held-out loss on the grid **over all variants of the sweep** (so that variants are
  compared against one common optimum; Wortsman et al. compare each model against the best loss
  reached on the grid).

Reported over the whole grid and over its high end (default [1e-2, 3e-1]), where instabilities
show; the low end mostly measures under-training. As App. B of the paper warns, the number is
blind to the loss scale and invalid if a variant changes what the LR means: look at the curves too
(``lr_sweep.png``, TensorBoard hparams). Runs in the CLI process; the runs go to the pool.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..results.run_result import DONE, RunResult
from ..results.summary import Summary
from ..results.verdict import judge
from ..run.job import Job, Progress
from ..run.pool import execute
from ..run.runner import clear_previous_logs, describe, history_checks, write_json
from ..run.signals import SigtermStop
from ..spec.recipe import Recipe

SWEEP = "sweep.json"
SWEPT = ("baseline", "intervention")
"""Roles a sweep trains: reference runs set their own LR, and a rescue's verdict needs a run, not a grid."""
PLOT = "lr_sweep.png"


def lr_sensitivity(
    losses: dict[float, float],
    init_loss: float,
    best: float,
    lo: float | None = None,
    hi: float | None = None,
) -> float:
    """Mean of min(ℓ(η), ℓ₀) − ℓ* over the grid's LRs in [lo, hi] (NaN when none)."""
    terms = []
    for lr, loss in losses.items():
        if (lo is not None and lr < lo * (1 - 1e-9)) or (hi is not None and lr > hi * (1 + 1e-9)):
            continue
        capped = init_loss if not math.isfinite(loss) else min(loss, init_loss)
        terms.append(capped - best)
    return sum(terms) / len(terms) if terms else math.nan


def run_dir(out: Path, variant: str, lr: float) -> Path:
    """Where one (variant, LR) run logs: ``<out>/<variant>/lr_<lr>``."""
    return out / variant / f"lr_{lr:.0e}"


RUN_ROW = ("status", "val_loss", "max_attn_logit", "diverged", "logdir")
"""What the sweep's table keeps of each run (from its summary entry, `RunResult.to_dict`)."""


def tabulate(
    recipe: Recipe, lrs: Sequence[float], runs: dict[str, dict[float, RunResult]]
) -> dict[str, dict[str, Any]]:
    """Per variant: the losses and max logits per LR, ℓ₀, and the sensitivities (ℓ* over all variants)."""
    finite = [
        r.val_loss
        for rs in runs.values()
        for r in rs.values()
        if r.status == DONE and math.isfinite(r.val_loss)
    ]
    best = min(finite) if finite else math.nan
    lo, hi = recipe.sweep.high
    out: dict[str, dict[str, Any]] = {}
    for name, by_lr in runs.items():
        done = {lr: r for lr, r in by_lr.items() if r.status == DONE}
        losses = {lr: r.val_loss for lr, r in done.items()}
        inits = [r.init_val_loss for r in done.values() if r.init_val_loss is not None]
        init = sum(inits) / len(inits) if inits else math.nan
        complete = len(done) == len(lrs)
        out[name] = {
            "status": "done" if complete else ("partial" if done else "not run"),
            "init_loss": init,
            "best_loss_all": best,
            "best_grid_loss": min(losses.values()) if losses else math.nan,
            "lr_sensitivity": lr_sensitivity(losses, init, best) if complete else math.nan,
            "lr_sensitivity_high": lr_sensitivity(losses, init, best, lo, hi) if complete else math.nan,
            "runs": {f"{lr:g}": r.pick(RUN_ROW) for lr, r in sorted(by_lr.items())},
        }
    return out


def run_sweep(
    recipe: Recipe,
    out: str | Path,
    *,
    lrs: Sequence[float] | None = None,
    device: str = "cpu",
    workers: int = 1,
    on_progress: Progress | None = None,
    on_update: Callable[[Summary], None] | None = None,
) -> Summary:
    """Run every non-reference variant at every LR of the grid; write ``<out>/sweep.json`` (after each
    run, ``"complete": false`` until the end), TensorBoard hparams and ``lr_sweep.png``. Returns the
    `Summary` (kind "sweep"; its variants are `tabulate`'s per-LR tables)."""
    out = Path(out)
    grid = sorted(lrs or recipe.sweep.lrs)
    variants = [v for v in recipe.variants if v.role in SWEPT]
    checks = history_checks(recipe)
    jobs = [
        Job(
            recipe,
            v.name,
            str(run_dir(out, v.name, lr)),
            device,
            lr=lr,
            run=f"{v.name} lr={lr:g}",
            history_checks=checks,
        )
        for lr in grid
        for v in variants
    ]
    clear_previous_logs(jobs)
    runs: dict[str, dict[float, RunResult]] = {v.name: {} for v in variants}
    started = time.perf_counter()
    summary = Summary(
        kind="sweep",
        **describe(recipe, device),
        lrs=grid,
        high=list(recipe.sweep.high),
        convention="l* = best held-out loss on the grid over all variants; l0 = held-out loss at init; "
        "non-finite losses count as l0",
        started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )

    def refresh() -> None:
        summary.variants = tabulate(recipe, grid, runs)
        summary.verdicts = sweep_verdicts(recipe, summary.variants)
        summary.seconds = time.perf_counter() - started
        write_json(out / SWEEP, summary.to_dict())

    def on_result(job: Job, result: RunResult) -> None:
        assert job.lr is not None
        runs[job.variant][job.lr] = result
        if result.status == DONE:
            write_hparams(Path(job.logdir), job.variant, job.lr, result)
        refresh()
        if on_update is not None:
            on_update(summary)

    refresh()
    with SigtermStop() as term:  # SIGTERM: every run stops at its next step, as on Ctrl-C
        summary.interrupted = execute(jobs, workers, on_progress, on_result, term) or term.hit
    if term.hit:
        summary.stopped_by = "SIGTERM"
    summary.complete = not summary.interrupted and all(
        v["status"] == "done" for v in tabulate(recipe, grid, runs).values()
    )
    refresh()
    summary.plot = plot(summary, out / PLOT)
    write_json(out / SWEEP, summary.to_dict())
    return summary


def sweep_verdicts(recipe: Recipe, table: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Verdicts on the sweep quantities ([sweep] reproduced / fixed)."""
    names = [v.name for v in recipe.variants if v.name in table]
    roles = {v.name: v.role for v in recipe.variants}
    fixed = {n: list(recipe.sweep.fixed) for n in names}
    verdicts = judge(names, roles, table, recipe.sweep.reproduced, fixed, {})
    return {n: v.to_dict() for n, v in verdicts.items()}


def write_hparams(logdir: Path, variant: str, lr: float, result: RunResult) -> None:
    """TensorBoard hparams of one run (variant, LR -> final losses and max logit) in its own folder."""
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    entry = result.to_dict()
    metrics = {
        f"hparam/{k}": float(entry.get(k, math.nan)) for k in ("val_loss", "final_loss", "max_attn_logit")
    }
    metrics = {k: v for k, v in metrics.items() if math.isfinite(v)}
    exp, ssi, sei = hparams({"variant": variant, "lr": lr}, metrics)
    with SummaryWriter(str(logdir)) as writer:
        for summ in (exp, ssi, sei):
            writer.file_writer.add_summary(summ)
        for key, value in metrics.items():
            writer.add_scalar(key, value)


def plot(summary: Summary, path: Path) -> str:
    """Final held-out loss and max attention logit vs peak LR, one line per variant. Returns the
    path, or a note when matplotlib (the `plot` extra) is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "skipped: matplotlib is not installed (pip install 'stabkit[plot]')"
    fig, (ax_loss, ax_logit) = plt.subplots(1, 2, figsize=(10, 4))
    for name, v in summary.variants.items():
        pts = [
            (float(lr), r["val_loss"], r.get("max_attn_logit"))
            for lr, r in v["runs"].items()
            if r.get("status") == "done"
        ]
        if not pts:
            continue
        ax_loss.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax_logit.plot(
            [p[0] for p in pts], [p[2] if p[2] is not None else math.nan for p in pts], marker="o", label=name
        )
    first: dict[str, Any] = next(iter(summary.variants.values()), {})
    if math.isfinite(first.get("best_loss_all", math.nan)):
        ax_loss.axhline(first["best_loss_all"], color="gray", linestyle=":", label="best on grid (ℓ*)")
    ax_loss.set(xscale="log", xlabel="peak learning rate", ylabel="final held-out loss", title=summary.recipe)
    ax_logit.set(
        xscale="log", yscale="log", xlabel="peak learning rate", ylabel="max attention logit (before any cap)"
    )
    ax_loss.legend()
    ax_logit.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
