"""Actions on an event: warn, raise, skip, rollback, dump.

`Actor.run(event, before_update=...)` runs when the detectors decide an event: in the optimizer
pre-step hook (before the update: non-finite values, gradient-norm spikes), at `Monitor.step`
(after it: loss / update-ratio spikes, drift, the optimizer-state check) or at the log interval
(warn only). Order: dump, rollback, skip, report (every event is reported), raise.

- warn: report the event (sinks print and log it).
- raise: report, then raise `stabkit.InstabilityError` carrying the event.
- skip: before the update, set every gradient to None: torch optimizers (SGD, Adam, AdamW...)
  then leave those parameters and their state untouched — parameters and optimizer state stay
  bitwise unchanged. After the update (a loss spike is known only at Monitor.step) it cannot
  act; the event says so — use rollback there.
- rollback: restore the newest in-memory snapshot taken at or before the event's step (PaLM's
  recipe) and report which steps' batches were thereby skipped; before the update it also skips it.
- dump: save the step's inputs (by value, on the CPU), RNG state, the event and a small state
  report to `<logdir>/stabkit-dumps/` (or `DetectConfig.dump_dir`). When the disk refuses (full,
  read-only), nothing is saved, `event.details["dump"]` says why, a warning says so once, and the
  event is still reported and acted on.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..events import Event, InstabilityError
from ..sinks.fanout import reason
from .config import DetectConfig
from .nonfinite import StepGuard
from .snapshots import SnapshotStore

if TYPE_CHECKING:
    from ..monitor import Monitor

MAX_PARAMS_IN_REPORT = 200


def skip_update(optimizer: torch.optim.Optimizer) -> None:
    """Make the coming `optimizer.step()` a no-op for every parameter (grads set to None)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def to_cpu(obj: Any) -> Any:
    """Copy every tensor inside `obj` (tuples, lists, dicts) to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_cpu(v) for v in obj)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    return obj


def state_report(monitor: Monitor) -> dict[str, Any]:
    """A small JSON-ready picture of the model and optimizer now (syncs; on an event only)."""
    named = list(monitor.model.named_parameters())
    names = [n for n, _ in named]
    norms = torch._foreach_norm([p.detach().float() for _, p in named]) if named else []
    values: list[float] = torch.stack(list(norms)).tolist() if named else []  # sync point (dump only)
    report: dict[str, Any] = {
        "nonfinite_params": [n for n, v in zip(names, values, strict=True) if not math.isfinite(v)],
        "param_norms": dict(list(zip(names, values, strict=True))[:MAX_PARAMS_IN_REPORT]),
        "metrics": dict(monitor.metrics),
    }
    opt = monitor.optimizer
    if opt is not None:
        report["optimizer"] = {
            "type": type(opt).__name__,
            "groups": [
                {k: v for k, v in g.items() if k != "params" and isinstance(v, int | float | tuple)}
                for g in opt.param_groups
            ],
        }
    return report


class Actor:
    """Carries out the configured actions of each event kind."""

    def __init__(
        self, monitor: Monitor, config: DetectConfig, snapshots: SnapshotStore | None, guard: StepGuard | None
    ) -> None:
        self.monitor = monitor
        self.config = config
        self.snapshots = snapshots
        self.guard = guard
        self._warned: set[str] = set()

    def run(self, event: Event, before_update: bool) -> None:
        """Act on `event` (already carrying its advice) and report it."""
        acts = self.config.actions[event.kind]
        optimizer = self.monitor.optimizer
        skipped = False
        if "dump" in acts:
            path = self.dump(event)
            if path is not None:
                event.details["dump"] = str(path)
        if "rollback" in acts:
            self._rollback(event)
            skipped = before_update
        if "skip" in acts:
            if before_update and optimizer is not None:
                skipped = True
            else:
                event.details["skip"] = (
                    "not possible: the update of this step was already applied (use rollback)"
                )
        if skipped and optimizer is not None:
            skip_update(optimizer)
            event.details["skipped_update"] = True
        event.details["actions"] = list(acts)
        self.monitor.report(event)
        if "raise" in acts:
            raise InstabilityError(event)

    def _rollback(self, event: Event) -> None:
        snap = self.snapshots.newest_before(event.step) if self.snapshots is not None else None
        if snap is None:
            event.details["rollback"] = "no snapshot taken at or before this step yet"
            return
        assert self.snapshots is not None
        self.snapshots.restore(snap)
        event.details["rollback"] = {
            "restored_step": snap.step,
            "skipped_steps": [snap.step, event.step],
            "note": (
                f"state restored to before step {snap.step}; the batches of steps {snap.step}..{event.step} "
                "are skipped (PaLM skipped 200–500 batches around each spike)"
            ),
        }

    def dump(self, event: Event) -> Path | None:
        """Save the step's inputs and a state report; the .pt path, or None when nothing was saved
        (no directory, or the disk refused: warned once, the event still reported, training goes on)."""
        logdir = self._logdir()
        root = self.config.dump_dir or (logdir / "stabkit-dumps" if logdir is not None else None)
        if root is None:
            self._warn_once(
                "no dir",
                "stabkit: action 'dump' needs a logdir (stabkit.attach(..., logdir=...)) or "
                "DetectConfig(dump_dir=...); nothing was saved",
            )
            return None
        stem = Path(root) / f"step{event.step:08d}-{event.kind}"
        try:
            self._save(event, stem)
        except Exception as exc:  # a full or read-only disk must not stop training nor lose the event
            for path in (stem.with_suffix(".pt"), stem.with_suffix(".json")):
                with contextlib.suppress(OSError):
                    path.unlink(missing_ok=True)
            event.details["dump"] = f"failed: {reason(exc)}"
            self._warn_once(
                "failed",
                f"stabkit: action 'dump' could not save to {root} ({reason(exc)}); the event is still "
                "reported and kept in Monitor.events, training goes on",
            )
            return None
        return stem.with_suffix(".pt")

    def _logdir(self) -> Path | None:
        """The folder the monitor's logs go to (a ``run-<n>`` subfolder when the logdir held a run)."""
        chosen = getattr(self.monitor.sinks, "logdir", None)
        return Path(chosen) if chosen is not None else self.monitor.logdir

    def _save(self, event: Event, stem: Path) -> None:
        stem.parent.mkdir(parents=True, exist_ok=True)
        forwards = self.guard.forwards if self.guard is not None else []
        report = state_report(self.monitor)
        payload = {
            "event": event.to_dict(),
            "inputs": [{"args": to_cpu(f.args), "kwargs": to_cpu(f.kwargs)} for f in forwards],
            "rng": [{"cpu": f.rng_cpu, "cuda": f.rng_cuda} for f in forwards],
            "report": report,
        }
        torch.save(payload, stem.with_suffix(".pt"))
        text = {"event": event.to_dict(), "micro_batches": len(forwards), **report}
        stem.with_suffix(".json").write_text(json.dumps(text, indent=1, default=str, allow_nan=True))

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
