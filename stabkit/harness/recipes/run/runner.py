"""`run_recipe`: train every variant of a recipe side by side and write ``<out>/summary.json``.

Runs in the CLI's process; under `stabkit run --nproc N` in every rank's process, where each variant
trains with DDP on all ranks at once, one variant after another, and only rank 0 writes the summary
(every rank computes the same one). The summary is rewritten after each variant ends, with
``"complete": false`` until every variant has finished, so Ctrl-C or a crash leaves a partial,
readable summary next to the variants' flushed logs (``<out>/<variant>/``: TensorBoard events and
``stabkit.jsonl``).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ....distributed import SINGLE, DistContext
from ....sinks.fanout import reason
from ....sinks.jsonl import json_safe
from ....sinks.rundir import clear_logs
from ..results.run_result import RunResult
from ..results.summary import Summary
from ..results.verdict import judge
from ..spec.checks import Check
from ..spec.recipe import Recipe
from .job import Job, Progress
from .pool import execute
from .signals import SigtermStop

SUMMARY = "summary.json"


def all_checks(recipe: Recipe) -> Iterable[Check]:
    """Every check of the recipe (criteria and per-variant lists)."""
    yield from recipe.reproduced
    yield from recipe.fixed
    for v in recipe.variants:
        yield from v.fixed or ()
        yield from v.mechanism


def clear_previous_logs(jobs: Iterable[Job]) -> None:
    """Remove what an earlier run of the same recipe left in each job's log folder (stabkit's JSONL
    log, TensorBoard event files, dumps), so reports and charts show this run only, and each worker's
    `attach` writes into the folder itself (not a ``run-<n>`` subfolder). Other files stay."""
    for job in jobs:
        clear_logs(job.logdir)


def history_checks(recipe: Recipe) -> list[tuple[str, str]]:
    """(agg, pattern) of the monitored series the checks read (computed in the workers)."""
    pairs = {(c.agg, c.metric) for c in all_checks(recipe) if c.is_history and c.agg}
    return sorted((a, m) for a, m in pairs if a is not None)


def plan(recipe: Recipe, out: Path, device: str, ddp: bool = False) -> list[Job]:
    """One job per variant, logging to ``<out>/<variant>`` (data-parallel jobs when `ddp`)."""
    checks = history_checks(recipe)
    return [
        Job(recipe, v.name, str(out / v.name), device, history_checks=checks, ddp=ddp)
        for v in recipe.variants
    ]


def criteria(recipe: Recipe) -> tuple[dict[str, list[Check]], dict[str, list[Check]]]:
    """Per variant: its "fixed" checks (own list or the recipe's default) and its mechanism checks."""
    fixed = {
        v.name: [] if v.role == "rescue" else list(recipe.fixed if v.fixed is None else v.fixed)
        for v in recipe.variants
    }  # a rescue is judged against the fixed-from-the-start variant instead (`verdict.judge_rescue`)
    mechanism = {v.name: list(v.mechanism) for v in recipe.variants}
    return fixed, mechanism


def verdicts(recipe: Recipe, results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Verdicts of the variants with a result, as dicts."""
    fixed, mechanism = criteria(recipe)
    order = [v.name for v in recipe.variants]
    roles = {v.name: v.role for v in recipe.variants}
    tolerance = {v.name: v.tolerance for v in recipe.variants if v.tolerance is not None}
    judged = judge(order, roles, results, recipe.reproduced, fixed, mechanism, tolerance)
    return {n: v.to_dict() for n, v in judged.items()}


def describe(recipe: Recipe, device: str, dist: DistContext = SINGLE) -> dict[str, Any]:
    """The run's settings, for the summary header (`Summary`'s header fields, and ``arch`` on a user's
    model)."""
    return {
        "processes": dist.world_size,
        "recipe": recipe.name,
        "description": recipe.description,
        "source": recipe.source,
        "size": recipe.size,
        "device": device,
        "seed": recipe.train.seed,
        "steps": recipe.train.steps,
        "data": data_name(recipe.data),
        "model": recipe.model.to_dict(),
        "train": asdict(recipe.train),
        "fault": asdict(recipe.fault) if recipe.fault else None,
        "expect": recipe.sizes.get(recipe.size, {}),
        "criteria": {
            "reproduced": [c.describe() for c in recipe.reproduced],
            "fixed": {n: [c.describe() for c in cs] for n, cs in criteria(recipe)[0].items()},
        },
        "variant_roles": {v.name: v.role for v in recipe.variants},
        # on a user's model only (``--model hf:llama``): its spec, skipped variants and notes
        **({"arch": recipe.adaptation.to_dict()} if recipe.adaptation is not None else {}),
    }


def data_name(data: Any) -> str:
    """The training data as a line: a path, a synthetic language's spec, or the embedded text."""
    if data is None:
        return "embedded (pydoc_data.topics)"
    return data if isinstance(data, str) else str(data.describe())


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write JSON atomically (a reader never sees half a file); non-finite floats become strings.
    A disk that refuses (full, read-only) is warned about, not raised: the runs go on and the
    command still prints its results."""
    tmp = path.with_suffix(".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(json_safe(data), indent=2), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        warnings.warn(f"stabkit: could not write {path} ({reason(exc)}); the runs go on", stacklevel=2)


def either(*asks: Callable[[], bool] | None) -> Callable[[], bool]:
    """A `should_stop` that says yes when any of `asks` does."""
    live = [a for a in asks if a is not None]
    return lambda: any(a() for a in live)


def run_recipe(
    recipe: Recipe,
    out: str | Path,
    *,
    device: str = "cpu",
    workers: int = 1,
    on_progress: Progress | None = None,
    on_update: Callable[[Summary], None] | None = None,
    dist: DistContext = SINGLE,
    should_stop: Callable[[], bool] | None = None,
) -> Summary:
    """Train the baseline and every variant (same seed, same data), judge them, and return the
    `Summary` (also written to ``<out>/summary.json``, `Summary.to_dict`, after each variant and at
    the end).

    With an active `dist` (this process is one rank of a torchrun job, process group initialised)
    every variant trains with DDP over all ranks, `workers` is ignored, and only rank 0 writes.
    `should_stop` is asked after each step (in the data-parallel case the ranks agree on it). A
    SIGTERM while it runs stops every job as Ctrl-C does (`SigtermStop`): the summary then says
    ``"interrupted": true, "stopped_by": "SIGTERM"``.
    """
    out = Path(out)
    jobs = plan(recipe, out, device, ddp=dist.active)
    if dist.writes:
        clear_previous_logs(jobs)
    workers = 1 if dist.active else workers
    started = time.perf_counter()

    def save() -> None:
        if dist.writes:
            write_json(out / SUMMARY, summary.to_dict())

    summary = Summary(
        kind="run",
        **describe(recipe, device, dist),
        started=datetime.now(timezone.utc).isoformat(timespec="seconds"),
    )
    save()

    results: dict[str, RunResult] = {}

    def on_result(job: Job, result: RunResult) -> None:
        results[job.variant] = result
        summary.variants[job.variant] = result.to_dict()
        summary.verdicts = verdicts(recipe, summary.variants)
        summary.seconds = time.perf_counter() - started
        save()
        if on_update is not None:
            on_update(summary)

    with SigtermStop() as term:
        interrupted = execute(jobs, workers, on_progress, on_result, either(should_stop, term))
    order = [v.name for v in recipe.variants]
    summary.variants = {n: summary.variants[n] for n in order if n in summary.variants}
    summary.interrupted = interrupted or term.hit
    if term.hit:
        summary.stopped_by = "SIGTERM"
    summary.complete = not summary.interrupted and all(r.finished for r in results.values())
    summary.verdicts = verdicts(recipe, summary.variants)
    summary.seconds = time.perf_counter() - started
    save()
    return summary


CHECK_ON_CPU_PARAMS = 50_000_000
"""A user's model with fewer parameters than this is checked on the CPU by `preflight` (an intervention
verifies itself with a forward, which the meta device cannot run); a larger one on the meta device."""


def preflight(recipe: Recipe) -> None:
    """Catch mistakes before anything trains: build the model on the meta device (no memory), apply
    each variant's interventions, and check that the fault's module exists. Raises ValueError.

    On a user's model (`Recipe.arch`) an intervention the model cannot take skips that variant, with
    the refusal as the reason (`Recipe.adaptation`); when it is the baseline's, RecipeNotApplicable."""
    import torch

    from ....interventions import InterventionError, apply_many
    from ...models.build import build
    from ..spec.arch import RecipeNotApplicable
    from .faults import fault_module

    for variant in list(recipe.variants):
        with torch.device("meta"):
            model = build(recipe.arch, recipe.model_of(variant))
        if recipe.arch is not None and sum(p.numel() for p in model.parameters()) < CHECK_ON_CPU_PARAMS:
            model = build(recipe.arch, recipe.model_of(variant))  # its interventions verify by a forward
        if recipe.fault is not None and recipe.fault.kind in ("nan", "inf"):
            names = {n for n, _ in model.named_modules()}
            if fault_module(model, recipe.fault.module) not in names:
                examples = ", ".join(sorted(n for n in names if n.count(".") <= 2 and n)[:8])
                raise ValueError(
                    f"fault.module {recipe.fault.module!r} is not a module of the model; e.g. {examples}"
                )
        if variant.interventions:
            try:
                apply_many(model, {k: dict(v) for k, v in variant.interventions.items()})
            except InterventionError as exc:
                if recipe.adaptation is None:
                    raise ValueError(f"variants.{variant.name}.interventions: {exc}") from None
                reason = f"{recipe.arch.text if recipe.arch else 'the model'} refuses it: {' '.join(str(exc).split())}"
                if variant.role == "baseline":
                    raise RecipeNotApplicable(f"{recipe.name}: baseline {reason}") from None
                recipe.adaptation.skipped[variant.name] = reason
                recipe.variants.remove(variant)
            except Exception:  # some surgery may not run on meta tensors; the worker will tell
                pass
