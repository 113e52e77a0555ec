"""One variant of a recipe, trained and measured in one process (a pool worker or the CLI itself),
or on every rank of a torchrun job at once (`Job.ddp`, see `ddp.py`).

`run_job` builds the model with the recipe's seed (so every variant starts from the same weights),
applies the variant's interventions to it (before the optimizer is built, so new gains train; and,
with DDP, before the DDP wrap), attaches a monitor (logdir ``<out>/<variant>``) and the detectors,
logs the interventions' own metrics (``logits/z_loss``) with the monitor's statistics, injects the
recipe's fault, trains, and returns a JSON-ready result. The interventions are applied here, not
by ``attach(..., interventions=)``, because the monitor removes those at detach, and the
held-out loss after training must be measured on the model as trained. Progress goes to an
optional callback; a set stop flag (or Ctrl-C) ends training at the next step with the logs flushed
and a result whose status is "interrupted". Exceptions become status "failed" (traceback in
``<logdir>/error.txt``), so one broken variant never loses the others.
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...config import MonitorConfig
from ...detectors import DetectConfig
from ...distributed import DistContext
from ...interventions import Handle
from ...monitor import Monitor, attach
from ..data import load_corpus
from ..models import GPT, PRESET_BATCH
from ..training import train
from . import ddp as ddp_mod
from .depth import depth_sweep
from .faults import FaultyCorpus, StepClock, autocast_forward, inject_output_fault
from .measures import heldout
from .recipe import Recipe
from .results import finish

Progress = Callable[[str, str, int, int, float], None]
"""progress(run, status, step, total, loss); status in start, step, done, failed, interrupted."""


@dataclass
class Job:
    """What one worker trains: a variant of a recipe, optionally at another peak LR (sweeps)."""

    recipe: Recipe
    variant: str
    logdir: str
    device: str = "cpu"
    lr: float | None = None
    """Peak LR override (LR sweeps); None keeps the variant's."""
    run: str = ""
    """Display name (default: the variant)."""
    history_checks: list[tuple[str, str]] = field(default_factory=list)
    """(agg, metric pattern) pairs of monitored series the criteria read."""
    ddp: bool = False
    """Train on every rank of the running process group with DDP (`stabkit run --nproc N`): every
    rank runs this job at the same time, each on its rows of the global batch."""

    @property
    def name(self) -> str:
        return self.run or self.variant


def monitor_config(recipe: Recipe, detect: dict[str, Any]) -> MonitorConfig:
    """The recipe's [monitor] table and the variant's detector settings as a MonitorConfig (no
    console: the CLI shows progress bars; the whole history kept: the verdicts aggregate over it)."""
    m = recipe.monitor
    return MonitorConfig(
        every=m.every,
        log_every=m.log_every,
        attn_every=m.attn_every,
        attn_sample_rows=m.attn_sample_rows or None,
        attn_sample_queries=m.attn_sample_queries or None,
        console=False,
        history=None,
        detect=DetectConfig(**detect),
    )


class Stop(KeyboardInterrupt):
    """Raised inside the training loop when the parent asks the worker to stop."""


def run_job(
    job: Job, progress: Progress | None = None, should_stop: Callable[[], bool] | None = None
) -> dict[str, Any]:
    """Train and measure one variant; never raises except for programming errors in the caller."""
    start = time.perf_counter()
    recipe, variant = job.recipe, job.recipe.variant(job.variant)
    spec = variant.train
    steps = spec.steps
    lr = job.lr if job.lr is not None else spec.lr
    result: dict[str, Any] = {
        "variant": variant.name,
        "run": job.name,
        "role": variant.role,
        "interventions": variant.interventions,
        "lr": lr,
        "steps": steps,
        "steps_done": 0,
        "logdir": job.logdir,
        "status": "running",
        "notes": [],
    }
    losses: list[float] = []
    holder: dict[str, Monitor] = {}
    report = progress or (lambda *a: None)
    report(job.name, "start", 0, steps, math.nan)
    ctx: DistContext | None = None
    try:
        ctx = ddp_mod.rank_context() if job.ddp else None
        device = torch.device(job.device)
        corpus_any: Any = load_corpus(recipe.data)
        fault = recipe.fault if variant.fault else None
        if fault is not None and fault.kind == "bad_batch":
            corpus_any = FaultyCorpus(corpus_any, fault, spec.grad_accum, spec.seed)
        batch = spec.batch_size or PRESET_BATCH[recipe.size]
        train_corpus: Any = corpus_any if ctx is None else ddp_mod.RankRows.for_rank(corpus_any, batch, ctx)
        if recipe.depth is not None:
            clean = load_corpus(recipe.data)
            depth_batch = min(batch, 16)  # enough for a grad-norm estimate, also at GPU sizes
            result["depth"] = depth_sweep(
                recipe.model, variant.interventions, recipe.depth, clean, depth_batch, spec.seed, device
            )
        model, handle = build_model(recipe, variant.interventions, spec.seed, device)
        clock = StepClock()
        if fault is not None and fault.kind in ("nan", "inf"):
            inject_output_fault(model, fault, clock)
            if ctx is not None:
                result["notes"].append(
                    "under DDP the detectors do not replay a non-finite step: not localized"
                )
        autocast_forward(model, spec.precision, device)
        tcfg = spec.to_train_config(batch)
        tcfg.lr, tcfg.eval_batches = lr, 1
        init = heldout(model, corpus_any, spec.eval_batches, tcfg.batch_size, recipe.model.context, device)
        result["init_val_loss"] = init["val_loss"]

        def factory(m: nn.Module, opt: torch.optim.Optimizer) -> Monitor:
            mon = attach(m, opt, logdir=job.logdir, config=monitor_config(recipe, variant.detect))
            holder["monitor"] = mon
            if handle is not None:
                log_intervention_metrics(mon, opt, handle)
            return mon

        every = max(1, steps // 100)
        agree = ddp_mod.StepAgreement(device, should_stop) if ctx is not None else None

        def on_step(step: int, loss: float) -> None:
            clock.step = step + 1
            if agree is not None:  # the mean loss over ranks; a stop every rank takes at this step
                loss, stop = agree(loss)
            else:
                stop = should_stop is not None and should_stop()
            losses.append(loss)
            if stop:
                raise Stop
            if step % every == 0 or step == steps - 1:
                report(job.name, "step", step + 1, steps, loss)

        train(
            model if ctx is None else ddp_mod.wrap(model, device),
            train_corpus,
            tcfg,
            context=recipe.model.context,
            monitor_factory=factory,
            on_step=on_step,
            device=device,
        )
        result.update(
            heldout(model, corpus_any, spec.eval_batches, tcfg.batch_size, recipe.model.context, device)
        )
        if isinstance(train_corpus, ddp_mod.RankRows):  # rows this rank trained on per micro-batch
            result["rows_per_process"] = train_corpus.drawn / max(1, len(losses) * spec.grad_accum)
        result["status"] = "done"
    except KeyboardInterrupt:
        result["status"] = "interrupted"
    except Exception as exc:
        result["status"] = "failed"
        result["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        if ctx is None or ctx.writes:  # with DDP, rank 0 writes (the ranks fail alike)
            Path(job.logdir).mkdir(parents=True, exist_ok=True)
            (Path(job.logdir) / "error.txt").write_text(traceback.format_exc(), encoding="utf-8")
    finally:
        mon = holder.get("monitor")
        if mon is not None:
            mon.detach()  # flushes the logs also when training was interrupted
    result.update(finish(job, result, losses, holder.get("monitor")))
    result["seconds"] = time.perf_counter() - start
    report(job.name, result["status"], len(losses), steps, losses[-1] if losses else math.nan)
    return result


def build_model(
    recipe: Recipe, interventions: dict[str, dict[str, Any]], seed: int, device: torch.device
) -> tuple[nn.Module, Handle | None]:
    """The recipe's GPT built with `seed` (same weights for every variant), interventions applied
    (their handle, None without interventions). Build the optimizer afterwards: new gains train."""
    from ...interventions import apply_many

    torch.manual_seed(seed)
    model = GPT(recipe.model)
    handle = apply_many(model, {k: dict(v) for k, v in interventions.items()}) if interventions else None
    return model.to(device), handle


def log_intervention_metrics(mon: Monitor, opt: torch.optim.Optimizer, handle: Handle) -> None:
    """Log `handle`'s metrics (e.g. ``logits/z_loss``) as the monitor logs those of interventions
    passed to `attach`: recorded after each optimizer step, committed by the `Monitor.step` that
    follows (reduced across ranks like the other statistics). Lives as long as the optimizer."""
    mon.write_text("stabkit/interventions", ", ".join(handle.names))

    def record(*_: Any) -> None:
        for name, value in handle.metrics().items():
            mon.recorder.add(name, value)

    opt.register_step_post_hook(record)
