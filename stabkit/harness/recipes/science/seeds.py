"""The seeds sweep behind `stabkit lead-time`: each recipe's baseline and reference runs over seeds,
with a held-out curve, and the lead-time table (`stabkit.harness.recipes.leadtime`).

Runs in the CLI's process; each (recipe, seed) is one `run_recipe` (its variants go to the pool) and
writes ``<out>/<recipe>/seed<k>/summary.json`` as it goes. A (recipe, seed) whose complete summary
is already there with the same settings is read back (and judged again by the recipe as it is now)
instead of trained again, so an interrupted sweep resumes where it stopped. The table goes to ``<out>/lead_time.json`` and ``lead_time.md``
after every (recipe, seed).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ...models.spec import ModelSpec
from ..run.job import Progress
from ..run.runner import SUMMARY, run_recipe, verdicts, write_json
from ..spec.loader import load_recipe
from ..spec.recipe import Recipe
from .leadtime import LeadRow, RunLead, format_table, lead_row, recipe_runs

ROLES = ("baseline", "reference")
"""What the table needs: the baseline (reproduces, gets lost, is warned) and the reference runs
(should stay quiet). Interventions and rescues are not trained."""
CURVE_POINTS = 20
"""Held-out evaluations per run (``train.eval_every = steps // CURVE_POINTS``)."""
TABLE_JSON = "lead_time.json"
TABLE_MD = "lead_time.md"


def run_label(recipe: str, seed: int, variant: str) -> str:
    """How progress names one run of the sweep: ``"<recipe> s<seed> <variant>"``."""
    return f"{recipe} s{seed} {variant}"


def seed_recipe(
    name: str,
    size: str | None,
    seed: int,
    steps: int | None = None,
    data: str | None = None,
    model: ModelSpec | None = None,
) -> Recipe:
    """`name` loaded for one seed (on `model`, None: the recipe's), with only its baseline and
    reference variants, each evaluating the held-out loss `CURVE_POINTS` times."""
    recipe = load_recipe(name, size, steps=steps, seed=seed, data=data, model=model)
    kept = [v for v in recipe.variants if v.role in ROLES]
    for v in kept:
        v.train = replace(v.train, eval_every=max(1, v.train.steps // CURVE_POINTS))
    recipe.variants = kept
    return recipe


def reusable(path: Path, recipe: Recipe) -> dict[str, Any] | None:
    """The summary at `path` when it is complete and was made with `recipe`'s settings."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    same = (
        data.get("complete") is True
        and data.get("recipe") == recipe.name
        and data.get("size") == recipe.size
        and data.get("seed") == recipe.train.seed
        and data.get("steps") == recipe.train.steps
        and (data.get("arch") or None) == (recipe.adaptation.to_dict() if recipe.adaptation else None)
        and set(data.get("variants", {})) == {v.name for v in recipe.variants}
        and all("val_curve" in r for r in data.get("variants", {}).values())
    )
    return data if same else None


@dataclass
class LeadReport:
    """The sweep's outcome: one row per recipe, every run behind them, and what was read back."""

    rows: list[LeadRow] = field(default_factory=list)
    runs: dict[str, list[RunLead]] = field(default_factory=dict)
    reused: list[str] = field(default_factory=list)
    """"<recipe> seed <k>" read back from an earlier sweep."""
    incomplete: list[str] = field(default_factory=list)
    """"<recipe> seed <k>" whose runs did not all finish (interrupted, failed)."""
    interrupted: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "rows": [r.to_dict() for r in self.rows],
            "runs": {name: [{**vars(r), "lead": r.lead} for r in runs] for name, runs in self.runs.items()},
            "reused": self.reused,
            "incomplete": self.incomplete,
            "interrupted": self.interrupted,
        }


def run_seeds(
    names: Sequence[str],
    seeds: Sequence[int],
    out: str | Path,
    *,
    size: str | None = None,
    steps: int | None = None,
    data: str | None = None,
    model: ModelSpec | None = None,
    device: str = "cpu",
    workers: int = 1,
    on_progress: Progress | None = None,
    on_table: Callable[[LeadReport], None] | None = None,
) -> LeadReport:
    """Train each recipe's baseline and reference over `seeds` and tabulate the lead times."""
    out = Path(out)
    report = LeadReport()
    for name in names:
        summaries: dict[int, dict[str, Any]] = {}
        for seed in seeds:
            recipe = seed_recipe(name, size, seed, steps, data, model)
            folder = out / recipe.name / f"seed{seed}"
            label = f"{recipe.name} seed {seed}"
            done = reusable(folder / SUMMARY, recipe)
            if done is not None:  # judged again: the recipe's criteria may have changed since
                done["verdicts"] = verdicts(recipe, done["variants"])
                report.reused.append(label)
            else:

                def progress(run: str, *rest: Any, _name: str = recipe.name, _seed: int = seed) -> None:
                    if on_progress is not None:
                        on_progress(run_label(_name, _seed, run), *rest)

                summary = run_recipe(recipe, folder, device=device, workers=workers, on_progress=progress)
                done = summary.to_dict()
                if not summary.complete:
                    report.incomplete.append(label)
                if summary.interrupted:
                    report.interrupted = True
            summaries[seed] = done
            report.runs[name] = recipe_runs(summaries)
            report.rows = [r for r in report.rows if r.recipe != name] + [lead_row(name, report.runs[name])]
            save(report, out)
            if on_table is not None:
                on_table(report)
            if report.interrupted:
                return report
    return report


def save(report: LeadReport, out: Path) -> None:
    """``lead_time.json`` (rows and runs) and ``lead_time.md`` (the table)."""
    write_json(out / TABLE_JSON, report.to_dict())
    with contextlib.suppress(OSError):  # write_json already warned about the folder
        (out / TABLE_MD).write_text(format_table(report.rows) + "\n", encoding="utf-8")
