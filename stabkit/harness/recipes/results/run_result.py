"""`RunResult`: what one job (a variant, maybe at another LR) produced, typed; and its `Status`.

Built by the worker (`run_job`) as the variant trains and by the pool for a job that never ran
(`RunResult.not_run`); the runner, the sweep and the width sweep read its fields. `to_dict` is the
variant's entry in ``summary.json`` exactly as the worker's plain dict used to write it — the same
keys in the same order, optional ones absent rather than null (tests/harness/recipes/test_run_result.py
compares with a summary written before this type existed) — so `stabkit report` and the checks, which
read summaries by metric name (`stabkit.harness.recipes.verdict`), see the same files. `from_dict`
reads such an entry back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from ...training import Heldout
from .clipping import CLIP_KEYS
from .moe_load import MOE_KEYS

Status = Literal["running", "done", "stopped", "failed", "interrupted", "not run"]
"""running (not ended yet), done (trained every step), stopped (stabkit stopped it on purpose:
`stabkit.InstabilityError`), failed (an error; traceback in ``<logdir>/error.txt``), interrupted
(Ctrl-C, SIGTERM, or a worker that ended), not run (cancelled before it started)."""

RUNNING: Status = "running"
DONE: Status = "done"
STOPPED: Status = "stopped"
FAILED: Status = "failed"
INTERRUPTED: Status = "interrupted"
NOT_RUN: Status = "not run"

FINISHED: tuple[Status, ...] = (DONE, STOPPED)
"""Statuses of a run that ended on its own terms and is measured: it trained every step, or stabkit
stopped it on purpose (`stabkit.InstabilityError`: the action 'raise', a failed rescue)."""

RESCUE_KEYS = ("rescues", "rescue_count", "rescue_fixes", "rescue_step", "steps_lost", "rescue_failed")
"""`stabkit.harness.recipes.rescue.rescue_quantities`, in its order."""
FAULT_KEYS = ("fault_step", "fault_detected", "fault_localized", "fault_loss_jump")
"""`stabkit.harness.recipes.results.fault_quantities`, in its order."""


@dataclass
class Measures:
    """The quantities of a run that ended, however it ended (`stabkit.harness.recipes.results.finish`):
    from its losses, its monitor's history and events, and the recipe's fault."""

    max_attn_logit: float
    max_attn_logit_at: str
    max_attn_logit_capped: float
    max_logz: float
    initial_loss: float
    final_loss: float
    best_loss: float
    nonfinite_steps: int
    first_nonfinite_step: float
    """Step of the first non-finite loss (NaN: none)."""
    bigram_loss: float
    diverged: float
    """1.0 / 0.0, NaN for a run that did not finish."""
    events: int
    event_counts: dict[str, int]
    """Events per kind (written as ``events/<kind>``)."""
    event_list: list[dict[str, Any]]
    """The first 50 events (`Event.to_dict`)."""
    first_event_step: float
    first_event_kind: str
    aggregates: dict[str, float]
    """``"<agg>(<pattern>)"`` -> value, for the recipe's checks on monitored series."""
    rescue: dict[str, Any] | None = None
    """`rescue_quantities` (a rescue variant, or a run where a rescue happened)."""
    fault: dict[str, float] | None = None
    """`fault_quantities` (recipes with a fault)."""
    depth_grad_ratio: float | None = None
    """The depth sweep's ratio (recipes with [depth])."""
    clipping: dict[str, Any] | None = None
    """`clip_quantities` (runs with ``qk_clip`` or the action ``clip``)."""
    moe: dict[str, Any] | None = None
    """`moe_quantities` (models with a mixture-of-experts router)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            k: getattr(self, k)
            for k in (
                "max_attn_logit", "max_attn_logit_at", "max_attn_logit_capped", "max_logz",
                "initial_loss", "final_loss", "best_loss", "nonfinite_steps", "first_nonfinite_step",
                "bigram_loss", "diverged", "events",
            )
        }  # fmt: skip
        out.update({f"events/{k}": n for k, n in self.event_counts.items()})
        out["event_list"] = self.event_list
        if self.rescue is not None:
            out.update(self.rescue)
        out["first_event_step"] = self.first_event_step
        out["first_event_kind"] = self.first_event_kind
        if self.fault is not None:
            out.update(self.fault)
        if self.depth_grad_ratio is not None:
            out["depth_grad_ratio"] = self.depth_grad_ratio
        if self.clipping is not None:
            out.update(self.clipping)
        if self.moe is not None:
            out.update(self.moe)
        out["aggregates"] = self.aggregates
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measures:
        plain = {
            k: data[k]
            for k in (
                "max_attn_logit", "max_attn_logit_at", "max_attn_logit_capped", "max_logz",
                "initial_loss", "final_loss", "best_loss", "nonfinite_steps", "first_nonfinite_step",
                "bigram_loss", "diverged", "events", "event_list", "first_event_step", "first_event_kind",
                "aggregates",
            )
        }  # fmt: skip
        return cls(
            **plain,
            event_counts={k.removeprefix("events/"): v for k, v in data.items() if k.startswith("events/")},
            rescue={k: data[k] for k in RESCUE_KEYS} if "rescue_count" in data else None,
            fault={k: data[k] for k in FAULT_KEYS} if "fault_step" in data else None,
            depth_grad_ratio=data.get("depth_grad_ratio"),
            clipping={k: data[k] for k in CLIP_KEYS if k in data} or None,
            moe={k: data[k] for k in MOE_KEYS if k in data} or None,
        )

    @classmethod
    def keys_of(cls, data: dict[str, Any]) -> set[str]:
        """The keys of `data` that belong to its measures."""
        own = {*cls.__dataclass_fields__, *RESCUE_KEYS, *FAULT_KEYS, *CLIP_KEYS, *MOE_KEYS} - {
            "event_counts",
            "rescue",
            "fault",
            "clipping",
            "moe",
        }
        return {k for k in data if k in own or k.startswith("events/")}


@dataclass
class RunResult:
    """One job's result. A job that started has a `role` (and the rest of its settings); one that
    never ran (`not_run`) has only its names, status, log folder and maybe an error."""

    variant: str
    run: str
    """The display name (a sweep's ``"<variant> lr=<lr>"``)."""
    logdir: str
    status: Status = RUNNING
    role: str | None = None
    """baseline | intervention | reference | rescue; None: the job never started."""
    interventions: dict[str, dict[str, Any]] = field(default_factory=dict)
    lr: float = math.nan
    """The peak LR it trained with."""
    steps: int = 0
    """Steps it was to train."""
    steps_done: int = 0
    notes: list[str] = field(default_factory=list)
    depth: dict[str, Any] | None = None
    """The init-time depth sweep (recipes with [depth])."""
    init_val_loss: float | None = None
    """Held-out loss before the first step."""
    val_curve: list[list[float]] | None = None
    """``[steps done, held-out loss]`` pairs (with ``train.eval_every``)."""
    stopped: dict[str, Any] | None = None
    """The event that stopped the run (status "stopped"): step, kind, message."""
    error: str | None = None
    """One line: why it failed, stopped or never reported."""
    heldout: Heldout | None = None
    """At the end (or when stabkit stopped it)."""
    rows_per_process: float | None = None
    """Under DDP: the rows of each micro-batch this rank trained on."""
    measures: Measures | None = None
    """Once it ended (`results.finish`)."""
    seconds: float | None = None
    """Wall time of the job."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Keys of a read-back entry this type does not know (kept, written back last)."""

    @classmethod
    def not_run(
        cls, variant: str, run: str, logdir: str, status: Status = NOT_RUN, error: str = ""
    ) -> RunResult:
        """The result of a job that never ran (cancelled) or whose process died."""
        return cls(variant, run, logdir, status, error=error or None)

    @property
    def finished(self) -> bool:
        """Done, or stopped by stabkit on purpose (`FINISHED`)."""
        return self.status in FINISHED

    @property
    def val_loss(self) -> float:
        """The held-out loss at the end (NaN when it was not measured)."""
        return self.heldout.val_loss if self.heldout is not None else math.nan

    def pick(self, keys: Sequence[str]) -> dict[str, Any]:
        """`keys` of the summary entry (None where it has none): a sweep's row of this run."""
        entry = self.to_dict()
        return {k: entry.get(k) for k in keys}

    def to_dict(self) -> dict[str, Any]:
        """The summary entry (see the module docstring)."""
        if self.role is None:
            out: dict[str, Any] = {"variant": self.variant, "run": self.run, "status": self.status}
            out["logdir"] = self.logdir
            if self.error is not None:
                out["error"] = self.error
            out.update(self.extra)
            return out
        out = {
            "variant": self.variant,
            "run": self.run,
            "role": self.role,
            "interventions": self.interventions,
            "lr": self.lr,
            "steps": self.steps,
            "steps_done": self.steps_done,
            "logdir": self.logdir,
            "status": self.status,
            "notes": self.notes,
        }
        for key in ("depth", "init_val_loss", "val_curve", "stopped", "error"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.heldout is not None:
            out.update(self.heldout.to_dict())
        if self.rows_per_process is not None:
            out["rows_per_process"] = self.rows_per_process
        if self.measures is not None:
            out.update(self.measures.to_dict())
        if self.seconds is not None:
            out["seconds"] = self.seconds
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunResult:
        """An entry of ``summary.json`` read back (the inverse of `to_dict`)."""
        names = ("variant", "run", "logdir", "status", "error")
        if "role" not in data:
            known = {k: data[k] for k in names if k in data}
            return cls(**known, extra={k: v for k, v in data.items() if k not in names})
        plain = (
            *names, "role", "interventions", "lr", "steps", "steps_done", "notes", "depth",
            "init_val_loss", "val_curve", "stopped", "rows_per_process", "seconds",
        )  # fmt: skip
        heldout = ("val_loss", "mean_logz", "mean_abs_logz", "mean_logit")
        measured = Measures.keys_of(data) if "max_attn_logit" in data else set()
        extra = {k: v for k, v in data.items() if k not in plain and k not in heldout and k not in measured}
        return cls(
            **{k: data[k] for k in plain if k in data},
            heldout=Heldout.from_dict(data) if "val_loss" in data else None,
            measures=Measures.from_dict(data) if measured else None,
            extra=extra,
        )
