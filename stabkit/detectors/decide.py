"""`Decider`: when each detector runs, what it reads, and which action runs where.

Three moments of a step (see `DetectConfig` for the timing trade-off):
- `pre_update` (optimizer step pre-hook, before the update): non-finite check (global grad norm,
  output flag, always-on tracer) and gradient-norm spikes — only for kinds that need a per-step
  decision; one stacked host copy (`# sync point`). Takes rollback snapshots.
- `post_update` (optimizer step post-hook): the fused parameter / optimizer-state check (device).
- `on_step` (Monitor observer, after commit): update check, loss / update-ratio spikes and drift for
  kinds that need a per-step decision; one stacked host copy. Then the step's kept data is released.
- `on_rows` (at the log interval's host copy): every kind whose actions are all 'warn', from the
  host rows; adds `spike/<series>/score` to the rows before the sinks write them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from ..distributed import host_values
from ..events import Event
from ..probes import parameter_units
from ..stats import Recorder
from .advice import advise
from .config import KINDS
from .localize import Finding, finding_event, locate_update_fault, replay
from .nonfinite import OUTPUT_METRIC, UPDATE_METRIC, nonfinite_any, optimizer_tensors

if TYPE_CHECKING:
    from ..monitor import Monitor
    from .wiring import DetectorHandle

GRAD_FLAG = "grad/nonfinite"
"""Recorded only when the grad probe is off: 1 when some gradient held NaN/Inf."""
Origin = tuple[torch.Tensor, torch.Tensor, list[tuple[str, str, str]]]


def _fetch(tensors: list[torch.Tensor], reductions: list[str]) -> list[float]:
    """Host values for a per-step decision, combined across ranks first (one collective when
    distributed), so every rank takes the same decision."""
    if not tensors:
        return []
    return host_values(tensors, reductions)  # sync point


class Decider:
    """Runs the detectors at the right moment for one DetectorHandle."""

    def __init__(self, handle: DetectorHandle) -> None:
        self.h = handle
        self.monitor = handle.monitor
        self.config = handle.config
        self.sync = {kind: self.config.needs_sync(kind) for kind in KINDS}
        _, _, units = parameter_units(self.monitor.model, self.monitor.model_map.block_of)
        groups = len(self.monitor.optimizer.param_groups) if self.monitor.optimizer is not None else 0
        self.grad_names = [f"grad/{u}/norm" for u in dict.fromkeys(units)] + [
            f"grad/param_group.{g}/norm" for g in range(groups)
        ]
        self.pre_names = list(dict.fromkeys(["grad/global_norm", *self.grad_names]))
        """Series judged before the update (gradient norms: a spike there can still skip the step)."""
        scaler = getattr(self.monitor, "scaler", None)
        self.scaled = scaler is not None and scaler.is_enabled()
        """An fp16 GradScaler is in use: non-finite gradients are expected and handled by it."""
        dist = getattr(self.monitor, "dist", None)
        self.can_replay = not getattr(dist, "active", False)
        """Replays re-run forward/backward on this rank alone, which a distributed job cannot do."""
        self.nonfinite_open = False
        """A non-finite run of steps is in progress (replay and the unlocalized report happen once per run)."""
        self._scores: dict[int, dict[str, float]] = {}
        self._origins: dict[int, Origin] = {}
        self._update_bad: torch.Tensor | None = None
        self._pre_done = False
        self._nonfinite_now = False
        self._acted = False

    # ------------------------------------------------------------------ before the update
    def pre_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Optimizer step pre-hook."""
        try:
            self._before_update(None)
        finally:
            if self.h.guard is not None:
                self.h.guard.release_grads()

    def _before_update(self, committed: dict[str, torch.Tensor] | None) -> None:
        mon, cfg, h = self.monitor, self.config, self.h
        self._pre_done = True
        step = mon.global_step
        value = committed.get if committed is not None else mon.recorder.current
        origin: Origin | None = None
        if h.tracer is not None:
            hit, index = h.tracer.first()
            origin = (hit, index, list(h.tracer.sites))
            self._origins[step] = origin
            h.tracer.reset()
        flag = self._nonfinite_flag(value, origin, record=committed is None) if cfg.nonfinite else None
        spikes: list[tuple[str, torch.Tensor]] = []
        if self.sync["spike"]:
            for name in self.pre_names:
                current = value(name) if self.h.spikes.wants(name) else None
                if current is not None:
                    spikes.append((name, current))
        first = [flag] if self.sync["nonfinite"] and flag is not None else []
        reductions = self.monitor.recorder.reductions
        host = _fetch(
            first + [t for _, t in spikes],
            ["max"] * len(first) + [reductions.get(n, "mean") for n, _ in spikes],
        )
        if first:
            if host.pop(0) > 0:
                self._nonfinite_before_update(step, origin)
                return
            self.nonfinite_open = False
        for (name, _), x in zip(spikes, host, strict=True):
            self._spike(step, name, x, before_update=True)
        snaps = h.snapshots
        if snaps is not None and not self._acted and snaps.due(step):
            snaps.take(step)

    def _nonfinite_flag(self, value: Any, origin: Origin | None, record: bool) -> torch.Tensor | None:
        flags = []
        norm = value("grad/global_norm")
        if self.scaled:
            pass  # fp16 GradScaler: overflowed gradients are its business (reported as amp/overflow)
        elif norm is not None:
            flags.append(~torch.isfinite(norm))
        else:
            grads = nonfinite_any(p.grad for p in self.monitor.model.parameters() if p.grad is not None)
            if grads is not None:
                flags.append(grads)
                if record:
                    self.h.record(GRAD_FLAG, grads.float())
        guard = self.h.guard
        if guard is not None and guard.output_bad is not None:
            flags.append(guard.output_bad)
        if origin is not None:
            flags.append(origin[0])
        if not flags:
            return None
        device = flags[0].device
        return torch.stack([f.to(device) for f in flags]).any()

    def _nonfinite_before_update(self, step: int, origin: Origin | None) -> None:
        finding: Finding | None = None
        if origin is not None and bool(origin[0]):  # sync point (on a hit only)
            path, pass_, tensor = origin[2][int(origin[1])]  # sync point (on a hit only)
            finding = Finding(pass_, path, tensor)
        elif self.config.localize and self.can_replay and self.h.guard is not None and self.h.guard.forwards:
            finding = self._replay()  # starts with a cheap check for weights an earlier update broke
        repeat = self.nonfinite_open
        self.nonfinite_open = self._nonfinite_now = True
        event = finding_event(step, finding, "grad/global_norm", math.nan)
        if repeat:
            event.details["repeat"] = True
            event.message += " (the previous step was non-finite too)"
        self._act(event, before_update=True)

    def _replay(self) -> Finding:
        mon, guard = self.monitor, self.h.guard
        assert guard is not None
        saved = mon.context.recorder
        mon.context.recorder = Recorder()  # the replay's statistics go nowhere
        guard.paused = True
        try:
            return replay(mon.model, guard.forwards, mon.optimizer, self.config.loss_fn)
        finally:
            mon.context.recorder = saved
            guard.paused = False
            if self.h.tracer is not None:
                self.h.tracer.reset()

    # ------------------------------------------------------------------ after the update
    def post_update(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Optimizer step post-hook: fused NaN/Inf check of parameters and optimizer state (device)."""
        every = self.config.optimizer_check_every
        if every is None:  # every step when a non-finite update must be acted on, else on sampled steps
            acting = any(a != "warn" for a in self.config.actions["nonfinite"])
            every = 1 if acting else self.monitor.config.every
        if not self.config.nonfinite or not every or self.monitor.global_step % every:
            return
        params = [p for p in self.monitor.model.parameters() if p.requires_grad]  # unfrozen ones too
        flag = nonfinite_any([*params, *optimizer_tensors(optimizer)])
        if flag is not None:
            self.h.record(UPDATE_METRIC, flag.float())
            self._update_bad = flag

    def on_step(self, monitor: Monitor, step: int, committed: dict[str, torch.Tensor]) -> None:
        """Monitor observer: decisions after the update, then release what the step kept."""
        try:
            if not self._pre_done:
                self._before_update(committed)
            self._after_update(step, committed)
        finally:
            self._pre_done = self._nonfinite_now = self._acted = False
            self._update_bad = None
            if self.h.guard is not None:
                self.h.guard.end_step()

    def _after_update(self, step: int, committed: dict[str, torch.Tensor]) -> None:
        nf = self.sync["nonfinite"] and self.config.nonfinite
        checks: list[tuple[str, torch.Tensor]] = []
        if nf and self._update_bad is not None:
            checks.append((UPDATE_METRIC, self._update_bad))
        if nf and "loss" in committed:
            checks.append(("loss", ~torch.isfinite(committed["loss"])))
        names: list[tuple[str, str]] = []
        pre = set(self.pre_names)
        if self.sync["spike"]:  # gradient norms were judged before the update
            names += [("spike", n) for n in committed if self.h.spikes.wants(n) and n not in pre]
        if self.sync["drift"]:
            names += [("drift", n) for n in committed if self.h.drifts.wants(n)]
        reductions = self.monitor.recorder.reductions
        host = _fetch(
            [t for _, t in checks] + [committed[n] for _, n in names],
            ["max"] * len(checks) + [reductions.get(n, "mean") for _, n in names],
        )
        bad = [name for (name, _), v in zip(checks, host, strict=False) if v > 0]
        host = host[len(checks) :]
        if UPDATE_METRIC in bad and not self._nonfinite_now:
            self.nonfinite_open = self._nonfinite_now = True
            finding = locate_update_fault(self.monitor.model, self.monitor.optimizer)
            self._act(finding_event(step, finding, UPDATE_METRIC, 1.0), before_update=False)
        elif bad and not self._nonfinite_now:
            self.nonfinite_open = True
            self._act(finding_event(step, None, bad[0], math.nan), before_update=False)
        for (kind, name), x in zip(names, host, strict=True):
            if kind == "spike":
                self._spike(step, name, x, before_update=False)
            else:
                self._drift(step, name, x, before_update=False)

    # ------------------------------------------------------------------ at the log interval
    def on_rows(self, monitor: Monitor, rows: list[tuple[int, dict[str, float]]]) -> None:
        """Drain hook: warn-only kinds decide from the host rows; spike scores join the rows."""
        for step, row in rows:
            if self.config.nonfinite and not self.sync["nonfinite"]:
                self._row_nonfinite(step, row)
            for name, x in list(row.items()):
                if not self.sync["spike"] and self.h.spikes.wants(name):
                    self._spike(step, name, x, before_update=False)
                if not self.sync["drift"] and self.h.drifts.wants(name):
                    self._drift(step, name, x, before_update=False)
            row.update(self._scores.pop(step, {}))
        if rows:
            last = rows[-1][0]
            self._scores = {s: v for s, v in self._scores.items() if s > last}
            self._origins = {s: v for s, v in self._origins.items() if s > last}

    def _row_nonfinite(self, step: int, row: dict[str, float]) -> None:
        watched = ("loss",) if self.scaled else ("loss", "grad/global_norm")
        bad: list[str] = [m for m in watched if m in row and not math.isfinite(row[m])]
        bad += [m for m in (OUTPUT_METRIC, GRAD_FLAG, UPDATE_METRIC) if row.get(m, 0.0) > 0]
        origin = self._origins.pop(step, None)
        if not bad:
            self.nonfinite_open = False
            return
        if self.nonfinite_open:
            return
        self.nonfinite_open = True
        finding = None
        if origin is not None and bool(origin[0]):  # sync point (on a hit only)
            path, pass_, tensor = origin[2][int(origin[1])]  # sync point (on a hit only)
            finding = Finding(pass_, path, tensor)
        self._act(finding_event(step, finding, bad[0], row[bad[0]]), before_update=False)

    # ------------------------------------------------------------------ shared
    def _spike(self, step: int, name: str, x: float, before_update: bool) -> None:
        event, score = self.h.spikes.update(step, name, x)
        if score is not None:
            self._scores.setdefault(step, {})[f"spike/{name}/score"] = score
        if event is not None:
            self._act(event, before_update)

    def _drift(self, step: int, name: str, x: float, before_update: bool) -> None:
        event = self.h.drifts.update(step, name, x)
        if event is not None:
            self._act(event, before_update)

    def _act(self, event: Event, before_update: bool) -> None:
        self._acted = True
        self.h.actor.run(advise(event, self.monitor.model_map), before_update)
