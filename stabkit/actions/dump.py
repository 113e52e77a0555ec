"""Action 'dump': save the step's inputs (by value, on the CPU), RNG state, the event and a small
state report to ``<logdir>/stabkit-dumps/`` (or `DumpOptions.dir`, ``DetectConfig.options["dump"]``). When the disk refuses
(full, read-only), nothing is saved, ``event.details["dump"]`` says why, a warning says so once, and
the event is still reported and acted on."""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..events import Event
from ..plugins import ACTIONS
from ..sinks.fanout import reason
from .base import Action, ActionContext

MAX_PARAMS_IN_REPORT = 200


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


def state_report(ctx: ActionContext) -> dict[str, Any]:
    """A small JSON-ready picture of the model and optimizer now (syncs; on an event only)."""
    named = list(ctx.model.named_parameters())
    names = [n for n, _ in named]
    norms = torch._foreach_norm([p.detach().float() for _, p in named]) if named else []
    values: list[float] = torch.stack(list(norms)).tolist() if named else []  # sync point (dump only)
    report: dict[str, Any] = {
        "nonfinite_params": [n for n, v in zip(names, values, strict=True) if not math.isfinite(v)],
        "param_norms": dict(list(zip(names, values, strict=True))[:MAX_PARAMS_IN_REPORT]),
        "metrics": dict(ctx.metrics()),
    }
    opt = ctx.optimizer
    if opt is not None:
        report["optimizer"] = {
            "type": type(opt).__name__,
            "groups": [
                {k: v for k, v in g.items() if k != "params" and isinstance(v, int | float | tuple)}
                for g in opt.param_groups
            ],
        }
    return report


@dataclass(frozen=True)
class DumpOptions:
    """``DetectConfig.options["dump"]``."""

    dir: str | None = None
    """Directory for batches and state reports (None = ``<logdir>/stabkit-dumps``)."""


@ACTIONS.register
class Dump(Action):
    """Save what is needed to reproduce the step."""

    name = "dump"
    order = 10
    options_class = DumpOptions

    def __init__(self, ctx: ActionContext) -> None:
        super().__init__(ctx)
        self.options = ctx.config.options_for(self.name, DumpOptions)
        self._warned: set[str] = set()

    def run(self, event: Event, before_update: bool) -> bool:
        path = self.dump(event)
        if path is not None:
            event.details["dump"] = str(path)
        return False

    def dump(self, event: Event) -> Path | None:
        """Save the step's inputs and a state report; the .pt path, or None when nothing was saved
        (no directory, or the disk refused: warned once, the event still reported, training goes on)."""
        logdir = self.ctx.logdir()
        root = self.options.dir or (logdir / "stabkit-dumps" if logdir is not None else None)
        if root is None:
            self._warn_once(
                "no dir",
                "stabkit: action 'dump' needs a logdir (stabkit.attach(..., logdir=...)) or "
                "DetectConfig(options={'dump': {'dir': ...}}); nothing was saved",
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

    def _save(self, event: Event, stem: Path) -> None:
        stem.parent.mkdir(parents=True, exist_ok=True)
        forwards = self.ctx.forwards()
        report = state_report(self.ctx)
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
