"""One variant of a recipe, trained and measured in one process (a pool worker or the CLI itself).

`run_job` builds the model with the recipe's seed (so every variant starts from the same weights),
applies the variant's interventions to it, attaches a monitor (logdir ``<out>/<variant>``) and the
detectors, injects the recipe's fault, trains, and returns a JSON-ready result. Progress goes to an
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

from ..config import MonitorConfig
from ..data import load_corpus
from ..models import GPT, PRESET_BATCH
from ..monitor import Monitor, attach
from ..training import train
from .depth import depth_sweep
from .faults import FaultyCorpus, StepClock, autocast_forward, inject_output_fault
from .measures import aggregate, best_smoothed, bigram_loss, heldout, monitored, tail_mean
from .recipe import Recipe
from .schema import FaultSpec

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

    @property
    def name(self) -> str:
        return self.run or self.variant


def monitor_config(recipe: Recipe) -> MonitorConfig:
    """The recipe's [monitor] table as a MonitorConfig (no console: the CLI shows progress bars)."""
    m = recipe.monitor
    return MonitorConfig(
        every=m.every,
        log_every=m.log_every,
        attn_every=m.attn_every,
        attn_sample_rows=m.attn_sample_rows or None,
        attn_sample_queries=m.attn_sample_queries or None,
        console=False,
    )


def install_detectors(monitor: Monitor, settings: dict[str, Any]) -> str | None:
    """Install `stabkit.detectors` with `settings` on `monitor`; returns a note when they are not available."""
    try:
        from ..detectors import DetectConfig, install
    except ImportError:
        return "detectors not installed (stabkit.detectors missing): no events"
    install(monitor, DetectConfig(**settings))
    return None


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
    try:
        device = torch.device(job.device)
        corpus_any: Any = load_corpus(recipe.data)
        fault = recipe.fault if variant.fault else None
        if fault is not None and fault.kind == "bad_batch":
            corpus_any = FaultyCorpus(corpus_any, fault, spec.grad_accum, spec.seed)
        batch = spec.batch_size or PRESET_BATCH[recipe.size]
        if recipe.depth is not None:
            clean = load_corpus(recipe.data)
            depth_batch = min(batch, 16)  # enough for a grad-norm estimate, also at GPU sizes
            result["depth"] = depth_sweep(
                recipe.model, variant.interventions, recipe.depth, clean, depth_batch, spec.seed, device
            )
        model = build_model(recipe, variant.interventions, spec.seed, device)
        clock = StepClock()
        if fault is not None and fault.kind in ("nan", "inf"):
            inject_output_fault(model, fault, clock)
        autocast_forward(model, spec.precision, device)
        tcfg = spec.to_train_config(batch)
        tcfg.lr, tcfg.eval_batches = lr, 1
        init = heldout(model, corpus_any, spec.eval_batches, tcfg.batch_size, recipe.model.context, device)
        result["init_val_loss"] = init["val_loss"]

        def factory(m: nn.Module, opt: torch.optim.Optimizer) -> Monitor:
            mon = attach(m, opt, logdir=job.logdir, config=monitor_config(recipe))
            holder["monitor"] = mon
            note = install_detectors(mon, variant.detect)
            if note:
                result["notes"].append(note)
            return mon

        every = max(1, steps // 100)

        def on_step(step: int, loss: float) -> None:
            clock.step = step + 1
            losses.append(loss)
            if should_stop is not None and should_stop():
                raise Stop
            if step % every == 0 or step == steps - 1:
                report(job.name, "step", step + 1, steps, loss)

        train(
            model,
            corpus_any,
            tcfg,
            context=recipe.model.context,
            monitor_factory=factory,
            on_step=on_step,
            device=device,
        )
        result.update(
            heldout(model, corpus_any, spec.eval_batches, tcfg.batch_size, recipe.model.context, device)
        )
        result["status"] = "done"
    except KeyboardInterrupt:
        result["status"] = "interrupted"
    except Exception as exc:
        result["status"] = "failed"
        result["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
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
) -> nn.Module:
    """The recipe's GPT built with `seed` (same weights for every variant), interventions applied."""
    from ..interventions import apply_many

    torch.manual_seed(seed)
    model = GPT(recipe.model)
    if interventions:
        apply_many(model, {k: dict(v) for k, v in interventions.items()})
    return model.to(device)


def finish(job: Job, result: dict[str, Any], losses: list[float], mon: Monitor | None) -> dict[str, Any]:
    """Quantities of a (possibly partial) run from its losses, monitor history and events."""
    recipe = job.recipe
    history = list(mon.history) if mon is not None else []
    events = [e.to_dict() for e in mon.events] if mon is not None else []
    out: dict[str, Any] = {"steps_done": len(losses), **monitored(history)}
    out["initial_loss"] = losses[0] if losses else math.nan
    out["final_loss"] = tail_mean(losses)
    out["best_loss"] = best_smoothed(losses)
    out["nonfinite_steps"] = sum(1 for v in losses if not math.isfinite(v))
    out["bigram_loss"] = bigram_loss(recipe.data)
    val = result.get("val_loss", math.nan)
    done = result["status"] == "done"
    out["diverged"] = float(not math.isfinite(val) or val >= out["bigram_loss"]) if done else math.nan
    out["events"] = len(events)
    kinds: dict[str, int] = {}
    for e in events:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
    out.update({f"events/{k}": n for k, n in kinds.items()})
    out["event_list"] = events[:50]
    out["first_event_step"] = events[0]["step"] if events else math.nan
    out["first_event_kind"] = events[0]["kind"] if events else ""
    fault = recipe.fault
    if fault is not None:
        out.update(fault_quantities(fault, events, losses))
    if "depth" in result:
        out["depth_grad_ratio"] = result["depth"]["depth_grad_ratio"]
    out["aggregates"] = {
        f"{agg}({pattern})": aggregate(history, pattern, agg)[0] for agg, pattern in job.history_checks
    }
    return out


def fault_quantities(fault: FaultSpec, events: list[dict[str, Any]], losses: list[float]) -> dict[str, float]:
    """Whether the detectors saw the injected fault (an event of the expected kind on its steps or
    the next), named its module (nan / inf), and how far the loss jumped on its steps (nats above
    the median of the 20 steps before)."""
    kind = "spike" if fault.kind == "bad_batch" else "nonfinite"
    window = [e for e in events if e["kind"] == kind and fault.step <= e["step"] <= fault.step + fault.length]
    before = sorted(v for v in losses[max(0, fault.step - 20) : fault.step] if math.isfinite(v))
    during = losses[fault.step : fault.step + fault.length]
    jump = math.nan
    if before and during:
        jump = (
            math.inf if any(not math.isfinite(v) for v in during) else max(during) - before[len(before) // 2]
        )
    return {
        "fault_step": float(fault.step),
        "fault_detected": float(bool(window)),
        "fault_localized": float(any(fault.module in str(e.get("where", "")) for e in window)),
        "fault_loss_jump": jump,
    }
