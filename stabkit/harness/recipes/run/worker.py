"""One variant of a recipe, trained and measured in one process (a pool worker or the CLI itself),
or on every rank of a torchrun job at once (`Job.ddp`, see `ddp.py`).

`run_job` fills one `RunResult` in four named steps: `build` (the recipe's GPT with the recipe's
seed, so every variant starts from the same weights; the variant's interventions applied before the
optimizer is built, so new gains train, and before any DDP wrap; the recipe's fault injected; the
loop's `TrainRun`: optimizer and precision), `watch` (a monitor attached to the model and the
optimizer, and to the GradScaler of an fp16 run that has one, logdir ``<out>/<variant>``, with the
variant's detectors), `train_variant` (the loop, stepping the monitor and recording the
interventions' own metrics, e.g. ``logits/z_loss``, after each optimizer step), and the measures
(`heldout` before and after, in the run's precision, and the quantities the verdicts read,
`results.finish`). The interventions are applied here, not by ``attach(..., interventions=)``,
because the monitor removes those at detach, and the held-out loss after training must be measured
on the model as trained. Progress goes to an optional callback; a set stop flag (or Ctrl-C) ends
training at the next step with the logs flushed and a result whose status is "interrupted". A
`stabkit.InstabilityError` (stabkit stopped training on purpose: the action 'raise', or a rescue
that failed) becomes status "stopped" with the event that stopped it (``stopped``: step, kind,
message) and the held-out loss of the model as it was then. Other exceptions become status
"failed" (traceback in ``<logdir>/error.txt``), so one broken variant never loses the others.
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ....attaching import attach
from ....config import MonitorConfig
from ....distributed import DistContext
from ....events import InstabilityError
from ....interventions import Handle
from ....monitor import Monitor
from ...data import load_corpus
from ...models import GPTConfig
from ...models.build import build as build_architecture
from ...models.spec import ModelSpec
from ...training import Callbacks, Heldout, TrainConfig, TrainRun, evaluate, train
from ..results.results import finish
from ..results.run_result import DONE, FAILED, INTERRUPTED, STOPPED, RunResult
from ..spec.recipe import Recipe, VariantSpec
from . import ddp as ddp_mod
from .depth import depth_sweep
from .faults import FaultyCorpus, StepClock, fault_module, inject_output_fault
from .job import Job, Progress

__all__ = ["Job", "Progress", "RunResult", "Stop", "run_job"]


class Stop(KeyboardInterrupt):
    """Raised inside the training loop when the parent asks the worker to stop."""


@dataclass
class Built:
    """A variant ready to train (`build`)."""

    model: nn.Module
    """The recipe's GPT with the variant's interventions and fault (measured as is)."""
    handle: Handle | None
    """The interventions' handle (their metrics are logged each step)."""
    corpus: Any
    """The variant's corpus (with a bad-batch fault when the recipe has one)."""
    trainer: TrainRun
    """What the loop trains: `model` or its DDP wrap, on `corpus` or this rank's rows of it, with the
    variant's training settings (a sweep's LR applied), its optimizer and precision."""
    clock: StepClock
    ctx: DistContext | None
    notes: list[str] = field(default_factory=list)
    fault_module: str | None = None
    """Where the nan / inf fault is injected (the recipe's path, or its place in a user's model)."""

    @property
    def config(self) -> TrainConfig:
        return self.trainer.config


def new_result(job: Job, variant: VariantSpec, config: TrainConfig) -> RunResult:
    """The result of a job that has not trained yet."""
    return RunResult(
        variant.name,
        job.name,
        job.logdir,
        role=variant.role,
        interventions=variant.interventions,
        lr=config.lr,
        steps=config.steps,
    )


def run_job(
    job: Job, progress: Progress | None = None, should_stop: Callable[[], bool] | None = None
) -> RunResult:
    """Train and measure one variant; never raises except for programming errors in the caller."""
    start = time.perf_counter()
    recipe, variant = job.recipe, job.recipe.variant(job.variant)
    config = replace(variant.train, lr=job.lr) if job.lr is not None else variant.train
    result = new_result(job, variant, config)
    losses: list[float] = []
    monitor: Monitor | None = None
    report = progress or (lambda *a: None)
    report(job.name, "start", 0, config.steps, math.nan)
    ctx: DistContext | None = None
    run: Built | None = None
    try:
        ctx = ddp_mod.rank_context() if job.ddp else None
        device = torch.device(job.device)
        if recipe.depth is not None:
            result.depth = measure_depth(recipe, variant, config, device)
        run = build(recipe, variant, config, device, ctx)
        result.notes += run.notes
        result.init_val_loss = heldout(recipe, run).val_loss
        monitor = watch(job, run)
        if config.eval_every:
            result.val_curve = [[0, result.init_val_loss]]
        train_variant(job, run, monitor, losses, report, should_stop, result.val_curve)
        result.heldout = heldout(recipe, run)
        if result.val_curve is not None:
            result.val_curve.append([len(losses), result.heldout.val_loss])
        rows = run.trainer.corpus
        if isinstance(rows, ddp_mod.RankRows):  # rows this rank trained on per micro-batch
            result.rows_per_process = rows.drawn / max(1, len(losses) * config.grad_accum)
        result.status = DONE
    except KeyboardInterrupt:
        result.status = INTERRUPTED
    except InstabilityError as exc:
        record_stop(recipe, run, result, exc)
    except Exception as exc:
        record_failure(job, result, exc, ctx)
    finally:
        if monitor is not None:
            monitor.detach()  # flushes the logs also when training was interrupted
    result.steps_done = len(losses)
    result.measures = finish(job, result, losses, monitor, run.fault_module if run is not None else None)
    result.seconds = time.perf_counter() - start
    report(job.name, result.status, len(losses), config.steps, losses[-1] if losses else math.nan)
    return result


def measure_depth(
    recipe: Recipe, variant: VariantSpec, config: TrainConfig, device: torch.device
) -> dict[str, Any]:
    """The init-time depth sweep of [depth] on clean data."""
    assert recipe.depth is not None
    depth_batch = min(config.batch_size, 16)  # enough for a grad-norm estimate, also at GPU sizes
    clean = load_corpus(recipe.data)
    return depth_sweep(
        recipe.model_of(variant), variant.interventions, recipe.depth, clean, depth_batch, config.seed, device
    )


def build(
    recipe: Recipe, variant: VariantSpec, config: TrainConfig, device: torch.device, ctx: DistContext | None
) -> Built:
    """The variant's model (interventions, fault) and data, and the loop's `TrainRun` over them
    (optimizer, precision), ready to train."""
    corpus: Any = load_corpus(recipe.data)
    fault = recipe.fault if variant.fault else None
    if fault is not None and fault.kind == "bad_batch":
        corpus = FaultyCorpus(corpus, fault, config.grad_accum, config.seed)
    train_corpus = corpus if ctx is None else ddp_mod.RankRows.for_rank(corpus, config.batch_size, ctx)
    model, handle = build_model(
        recipe.model_of(variant), variant.interventions, config.seed, device, recipe.arch
    )
    clock = StepClock()
    notes = []
    at = None
    if fault is not None and fault.kind in ("nan", "inf"):
        at = fault_module(model, fault.module)
        inject_output_fault(model, replace(fault, module=at), clock)
        if ctx is not None:
            notes.append("under DDP the detectors do not replay a non-finite step: not localized")
    if ctx is not None and variant.role == "rescue":
        notes.append(
            f"{variant.name}: under DDP the gains a rescue adds join the optimizer but not DDP's gradient "
            "averaging (they are added after the wrap): judge a rescue on one process"
        )
    net = model if ctx is None else ddp_mod.wrap(model, device)
    trainer = TrainRun(net, train_corpus, config, recipe.model.context, device)
    if handle is not None:  # fixes that act after optimizer steps (qk_clip) watch the optimizer
        from ....interventions import attach_optimizer

        attach_optimizer(handle, trainer.optimizer)
    return Built(model, handle, corpus, trainer, clock, ctx, notes, at)


def build_model(
    config: GPTConfig,
    interventions: dict[str, dict[str, Any]],
    seed: int,
    device: torch.device,
    arch: ModelSpec | None = None,
) -> tuple[nn.Module, Handle | None]:
    """The variant's model (the reference GPT, or `arch` at `config`'s size) built with `seed` (same
    weights for every variant), interventions applied (their handle, None without interventions).
    Build the optimizer afterwards: new gains train."""
    from ....interventions import apply_many

    torch.manual_seed(seed)
    model = build_architecture(arch, config)
    handle = apply_many(model, {k: dict(v) for k, v in interventions.items()}) if interventions else None
    return model.to(device), handle


def monitor_config(recipe: Recipe, variant: VariantSpec) -> MonitorConfig:
    """The recipe's [monitor] settings with the variant's detectors; no console (the CLI shows
    progress bars) and the whole history kept (the verdicts aggregate over it)."""
    return replace(recipe.monitor, detect=variant.detect, console=False, history=None)


def watch(job: Job, run: Built) -> Monitor:
    """A monitor attached to the model that trains, its optimizer and (fp16 with one) its GradScaler."""
    variant = job.recipe.variant(job.variant)
    trainer = run.trainer
    monitor = attach(
        trainer.model,
        trainer.optimizer,
        logdir=job.logdir,
        config=monitor_config(job.recipe, variant),
        scaler=trainer.amp.scaler,
        lr=run.config.lr,
        warmup_steps=run.config.warmup,
    )
    if run.handle is not None:
        monitor.write_text("stabkit/interventions", ", ".join(run.handle.names))
    return monitor


def train_variant(
    job: Job,
    run: Built,
    monitor: Monitor,
    losses: list[float],
    report: Progress,
    should_stop: Callable[[], bool] | None,
    val_curve: list[list[float]] | None = None,
) -> None:
    """Train `run` with `monitor` stepped after each optimizer step (the interventions' metrics
    recorded first, committed by that step and reduced across ranks like the other statistics);
    losses go to `losses` as they come, and with ``train.eval_every`` the held-out loss after every
    that many steps to `val_curve` as ``[steps done, loss]``. Raises `Stop` when asked to stop (the
    ranks agree on it)."""
    steps = run.config.steps
    every = max(1, steps // 100)
    agree = ddp_mod.StepAgreement(run.trainer.device, should_stop) if run.ctx is not None else None
    handle = run.handle
    curve = val_curve if val_curve is not None else []

    def after_update(loss: torch.Tensor) -> None:
        if handle is not None:
            for name, value in handle.metrics().items():
                monitor.recorder.add(name, value)
        monitor.step(loss)

    def on_step(step: int, loss: float) -> None:
        run.clock.step = step + 1
        if agree is not None:  # the mean loss over ranks; a stop every rank takes at this step
            loss, stop = agree(loss)
        else:
            stop = should_stop is not None and should_stop()
        losses.append(loss)
        if stop:
            raise Stop
        if run.config.eval_every and (step + 1) % run.config.eval_every == 0 and step + 1 < steps:
            curve.append([step + 1, heldout(job.recipe, run, curve=True).val_loss])
        if step % every == 0 or step == steps - 1:
            report(job.name, "step", step + 1, steps, loss)

    # the held-out loss after training is measured unmonitored: on_end detaches the monitor
    train(run.trainer, Callbacks(after_update=after_update, on_step=on_step, on_end=monitor.detach))


def heldout(recipe: Recipe, run: Built, curve: bool = False) -> Heldout:
    """Held-out loss and log Z of the model as it is now, in the run's precision (the same batches
    every time; a point of the curve during training uses the first quarter of them, at least one)."""
    config = run.config
    batches = max(1, config.eval_batches // 4) if curve else config.eval_batches
    return evaluate(
        run.model,
        run.corpus,
        batches=batches,
        batch_size=config.batch_size,
        context=recipe.model.context,
        device=run.trainer.device,
        amp=run.trainer.amp,
    )


def record_stop(recipe: Recipe, run: Built | None, result: RunResult, exc: InstabilityError) -> None:
    """Status "stopped": stabkit stopped training (`InstabilityError`); the event that stopped it, and
    the held-out loss of the model as it was then (the run's numbers stay comparable)."""
    event = exc.event
    result.status = STOPPED
    result.stopped = {"step": event.step, "kind": event.kind, "message": event.message}
    result.error = f"stopped by stabkit at step {event.step}: {' '.join(str(event.message).split())}"
    if run is None:
        return
    try:
        result.heldout = heldout(recipe, run)
    except Exception as error:  # the model may be broken beyond evaluating: say so, keep the stop
        result.notes.append(f"held-out loss after the stop not measured ({type(error).__name__})")


def record_failure(job: Job, result: RunResult, exc: Exception, ctx: DistContext | None) -> None:
    """Status "failed", the error in one line, the traceback in ``<logdir>/error.txt`` (with DDP,
    rank 0 writes: the ranks fail alike)."""
    result.status = FAILED
    result.error = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    if ctx is None or ctx.writes:
        Path(job.logdir).mkdir(parents=True, exist_ok=True)
        (Path(job.logdir) / "error.txt").write_text(traceback.format_exc(), encoding="utf-8")
