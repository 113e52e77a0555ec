"""The alarm benchmark behind `stabkit alarms`: the healthy corpus (quiet runs, and runs with planted
spikes) and the failing recipes' baselines over seeds, tabulated per detector kind (`stats.table`).

Runs in the CLI's process once per command: corpus runs go to `parallel.run_jobs`, recipes to the
seeds sweep of `stabkit lead-time` (`stabkit.harness.recipes.science.seeds.run_seeds`, whose finished runs
under ``<out>/recipes`` are read back instead of trained again). Writes ``<out>/alarms.json`` and
``<out>/alarms.md``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .corpus import HealthyConfig, select
from .parallel import CorpusJob, run_jobs
from .runner import Spike
from .stats import LostRun, format_rows, table

RESULT_JSON = "alarms.json"
RESULT_MD = "alarms.md"
QUICK_RECIPES = ("loss-spike", "nan-injection")
"""The recipes of ``--quick`` (one seed each)."""
QUICK_STEPS = 100
PLANT_TAG = "plant"


def planted_spikes(steps: int) -> tuple[tuple[Spike, ...], tuple[Spike, ...]]:
    """Two runs' spikes: ×20 early and ×5 late, then ×5 early and ×20 late (early: step 30, or a fifth
    of a shorter run; late: 70 % of the run)."""
    early, late = min(30, steps // 5), int(steps * 0.7)
    return (Spike(early, 20.0), Spike(late, 5.0)), (Spike(early, 5.0), Spike(late, 20.0))


@dataclass
class BenchPlan:
    """What one `stabkit alarms` runs."""

    configs: list[HealthyConfig]
    planted: list[HealthyConfig]
    steps: int | None = None
    """Optimizer steps of every corpus run (None: each config's own)."""
    monitors: tuple[str | None, ...] = (None,)
    """Monitor modes per healthy config (None: the config's own; ``both``: default and full)."""
    recipes: tuple[str, ...] = ()
    seeds: int = 3
    recipe_steps: int | None = None
    workers: int = 2

    def jobs(self) -> tuple[list[CorpusJob], list[CorpusJob]]:
        """(healthy jobs, planted jobs)."""
        healthy = [CorpusJob(c, self.steps, (), m) for c in self.configs for m in self.monitors]
        planted = [
            CorpusJob(c, self.steps, spikes)
            for c in self.planted
            for spikes in planted_spikes(self.steps or c.steps)
        ]
        return healthy, planted


def quick_plan(workers: int = 2) -> BenchPlan:
    """The CI subset: the ``ci`` configs × `QUICK_STEPS`, two of them planted, two recipes × one seed."""
    ci = select(tag="ci")
    return BenchPlan(ci, ci[:2], QUICK_STEPS, (None,), QUICK_RECIPES, 1, None, workers)


def full_plan(
    pattern: str | None = None,
    steps: int | None = None,
    workers: int = 2,
    recipes: Sequence[str] = (),
    seeds: int = 3,
) -> BenchPlan:
    """Every config matching `pattern` (each in its own monitor mode), the ``plant`` ones planted."""
    configs = select(pattern)
    planted = [c for c in configs if PLANT_TAG in c.tags or "ci" in c.tags]
    return BenchPlan(configs, planted, steps, (None,), tuple(recipes), seeds, None, workers)


@dataclass
class BenchResult:
    """Everything the table was made from, JSON-ready."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    healthy: list[dict[str, Any]] = field(default_factory=list)
    planted: list[dict[str, Any]] = field(default_factory=list)
    lost: list[dict[str, Any]] = field(default_factory=list)
    recipe_reference: list[dict[str, Any]] = field(default_factory=list)
    """The recipes' reference runs (healthy too: their warnings count as false alarms)."""
    not_falling: list[str] = field(default_factory=list)
    """Healthy runs whose loss did not fall (a corpus entry that is not healthy) or that failed."""
    wall_s: float = 0.0
    table: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def loss_fell(result: dict[str, Any], margin: float = 0.5) -> bool:
    """A healthy run's check on itself: finished, and the last losses clearly below the first."""
    first, last = result.get("first_loss"), result.get("last_loss")
    return not result.get("error") and first is not None and last is not None and last < first - margin


def run_bench(
    plan: BenchPlan,
    out: Path,
    on_result: Callable[[str, dict[str, Any]], None] | None = None,
    on_progress: Callable[..., None] | None = None,
) -> BenchResult:
    """Run `plan`, write ``alarms.json`` / ``alarms.md`` under `out`, and return the result."""
    start = time.perf_counter()
    healthy_jobs, planted_jobs = plan.jobs()
    tell = on_result or (lambda label, res: None)
    results = run_jobs([*healthy_jobs, *planted_jobs], plan.workers, lambda job, res: tell(job.label, res))
    healthy, planted = results[: len(healthy_jobs)], results[len(healthy_jobs) :]
    lost: list[LostRun] = []
    references: list[dict[str, Any]] = []
    if plan.recipes:  # the corpus part first, so a long recipe sweep that is stopped leaves it behind
        _save(_result(healthy, planted, [], [], start), out)
        lost, references = recipe_runs(plan, out / "recipes", on_progress)
    result = _result(healthy, planted, lost, references, start)
    _save(result, out)
    return result


def _result(
    healthy: list[dict[str, Any]],
    planted: list[dict[str, Any]],
    lost: list[LostRun],
    references: list[dict[str, Any]],
    start: float,
) -> BenchResult:
    rows = table([*healthy, *references], planted, lost)
    return BenchResult(
        rows=[r.to_dict() for r in rows],
        healthy=healthy,
        planted=planted,
        lost=[{"label": r.label, "lost": r.lost, "events": list(r.events)} for r in lost],
        recipe_reference=references,
        not_falling=[r.get("label", r.get("name", "?")) for r in healthy if not loss_fell(r)],
        wall_s=time.perf_counter() - start,
        table=format_rows(rows),
    )


def _save(result: BenchResult, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULT_JSON).write_text(json.dumps(result.to_dict(), indent=1, default=str), encoding="utf-8")
    (out / RESULT_MD).write_text(result.table + "\n", encoding="utf-8")


def recipe_runs(
    plan: BenchPlan, out: Path, on_progress: Callable[..., None] | None = None
) -> tuple[list[LostRun], list[dict[str, Any]]]:
    """Train the recipes' baselines and references over seeds (`stabkit lead-time`'s sweep) and read
    back: each lost baseline run (`leadtime.lost_step`) and each reference run as a healthy outcome."""
    from ..recipes.science.leadtime import lost_step
    from ..recipes.science.seeds import run_seeds

    run_seeds(
        list(plan.recipes), range(plan.seeds), out, steps=plan.recipe_steps, workers=plan.workers,
        on_progress=on_progress,
    )  # fmt: skip
    lost: list[LostRun] = []
    references: list[dict[str, Any]] = []
    for name in plan.recipes:
        for seed in range(plan.seeds):
            path = out / name / f"seed{seed}" / "summary.json"
            try:
                summary = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            variants = summary.get("variants", {})
            ref = next((r for r in variants.values() if r.get("role") == "reference"), None)
            for vname, res in variants.items():
                events = tuple(res.get("event_list") or [])
                label = f"{name} s{seed} {vname}"
                if res.get("role") == "reference":
                    references.append(
                        {
                            "label": label,
                            "name": label,
                            "events": list(events),
                            "steps": summary.get("steps", 0),
                        }
                    )
                elif res.get("role") == "baseline":
                    at = lost_step(res, ref)
                    if at is not None:
                        lost.append(LostRun(label, at, events))
    return lost, references
