"""`stabkit.attach` and `Monitor`: the one place that wires discovery, probes, detectors, actions,
stats and sinks. Every hook on the user's model and optimizer is registered here, through the
Monitor's `HookSet` (`stabkit.hooks`), in this order: the input guard, the probes (in
`stabkit.plugins.PROBES` order), the detectors (`stabkit.decisions`: their device parts' hooks —
the non-finite step guard, tracer — and the optimizer hooks).

Timeline of one training step with a monitor attached:
1. forward: probes' forward hooks add device statistics (sampled steps only);
2. backward: post-accumulate-grad hooks keep each parameter's gradient norm on the device;
3. `optimizer.step()`: the step pre-hook combines grad norms (and snapshots for update ratios),
   the post-hook computes update ratios; with `optimizer.step(closure)` (Lightning, LBFGS) the
   closure makes the gradients inside `step`, and stabkit's pre-hooks run right after its first
   call (`stabkit.hooks.AfterClosure`);
4. `Monitor.step(loss)`: the step's statistics are committed; once per log interval they are
   copied to the host in one transfer and written to the sinks.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from . import lifecycle
from .attach_checks import (
    check_optimizer,
    check_schedule,
    unwrap_compiled,
)
from .compiled_code import forget_compiled_code
from .config import MonitorConfig
from .decisions import Decisions, Wiring
from .detect_config import DetectConfig
from .discovery import DiscoveryError, ModelMap, inspect_model
from .discovery.discover import WAIT, logits_only, report_gaps, trace_first, traced_map
from .distributed import detect, finish_ratios, rank_sinks, reduce_stacked, unwrap_data_parallel
from .events import Event, InstabilityError
from .hooks import HookSet, flush_hook_warnings
from .incidents import IncidentLog
from .interventions import Handle
from .optimizers import OptimizerSet, as_optimizer
from .plugins import PROBES
from .probes import Probe, ProbeContext
from .stats import Recorder
from .stats.step_facts import StepFacts

InterventionSpecs = list[str | tuple[str, Any]] | dict[str, Any]
"""What `attach(..., interventions=...)` takes: names, (name, options) pairs, or {name: options}."""


def build_probes(config: MonitorConfig) -> list[Probe]:
    """One instance of every registered probe that serves a family in `config.families`, in order."""
    return [cls() for cls in PROBES.classes() if set(cls.families) & config.families]


class Monitor:
    """Hooks on one model (and optimizer) that turn each step into stability statistics.

    Create it with `stabkit.attach`. Use as a context manager, or call `detach()` at the end.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        *,
        logdir: str | Path | None = None,
        config: MonitorConfig | None = None,
        model_map: ModelMap | dict[str, Any] | None = None,
        interventions: InterventionSpecs | None = None,
        scaler: torch.amp.GradScaler | None = None,
        example: Any = None,
        lr: float | None = None,
        warmup_steps: int | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"stabkit.attach expects a torch.nn.Module, got {type(model).__name__}; pass the model object"
            )
        if config is not None and not isinstance(config, MonitorConfig):
            raise TypeError(f"config must be a stabkit.MonitorConfig, got {type(config).__name__}")
        model = unwrap_compiled(unwrap_data_parallel(unwrap_compiled(model)))
        forget_compiled_code()
        optimizer = as_optimizer(optimizer)
        check_optimizer(model, optimizer)
        self.model = model
        self.scaler = scaler
        check_schedule(lr, warmup_steps)
        self.schedule: dict[str, Any] = {"lr": lr, "warmup_steps": warmup_steps}
        """The run's peak LR and warmup as the caller said them (None: not known): the audit at
        attach and the detectors (`DetectorContext.warmup_steps`) read them."""
        self._device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.optimizer: Any = optimizer
        """The optimizer (or `stabkit.optimizers.OptimizerSet` of several) the monitor watches."""
        self.config = config or MonitorConfig()
        self.logdir = Path(logdir) if logdir is not None else None
        self.interventions: Handle | None = None
        """The handle of the interventions `attach` switched on (None when none were asked for)."""
        self._model_map: ModelMap | None = None
        self.dist = detect(model)
        """This rank's place in a torch.distributed job (mode 'single' when not distributed)."""
        self.facts = StepFacts(scaler=scaler, dist=self.dist)
        """What the step knows, shared by the probes and the detectors' device parts."""
        self.recorder = Recorder(reducer=reduce_stacked if self.dist.active else None)
        self._metrics: dict[str, float] = {}
        self._peeked = 0
        """Pending (not yet flushed) steps already copied into `_metrics` by a read of `metrics`."""
        self.history: deque[tuple[int, dict[str, float]]] = deque(maxlen=self.config.history)
        """(step, values) of the last `MonitorConfig.history` logged steps, oldest first."""
        self.events: list[Event] = []
        """Every event detectors reported, in order."""
        self.incidents = IncidentLog()
        """The events grouped by cause (`stabkit.incidents`): ``mon.incidents.incidents``, newest last."""
        self.hooks = HookSet()
        """Every hook stabkit put on the model and optimizer (`describe_hooks()` lists them)."""
        self._step = 0
        self._detached = False
        self.flush_every_step = False
        """Set on SIGTERM (`stabkit.lifecycle`): every `step()` writes out at once."""
        self.probes: list[Probe] = []
        self._ending: list[Probe] = []
        self._finishing: list[Probe] = []
        """The probes that add host values to the rows after the host copy (`Probe.finish_rows`)."""
        """The probes with work at `step` (an `end_step` of their own), listed once at attach."""
        self.detectors: Decisions | None = None
        """The detectors and actions (`stabkit.decisions`), installed after the probes; None when
        `MonitorConfig.detect` is None."""
        self.audit_report: Any = None
        self._pending: list[Any] | None = None
        self.sinks = rank_sinks(self.logdir, self.config, self.dist)  # only rank 0 writes under DDP/FSDP
        if self.sinks.logdir is not None:  # a run-<n> subfolder when the logdir already held a run
            self.logdir = self.sinks.logdir
        lifecycle.register(self)
        if model_map is None and example is None and trace_first(model) == WAIT:
            self._wait_for_first_forward(interventions)
            return
        try:
            self._finish_attach(model_map, example, interventions)
        except BaseException:
            self.sinks.close()
            lifecycle.unregister(self)
            raise

    def _wait_for_first_forward(self, interventions: InterventionSpecs | None) -> None:
        """At attach, when stabkit can make no input for the model: a forward pre-hook on every module
        (a wrapper such as a LightningModule may never run its own forward) finishes attaching at the
        model's first forward (`_discover_on_first_forward`)."""
        self._pending_paths = {id(m): n for n, m in self.model.named_modules()}
        self._interventions_spec = interventions
        self._pending = [
            self.hooks.forward_pre(
                "discovery", m, self._discover_on_first_forward, prepend=True, with_kwargs=True
            )
            for m in self.model.modules()
        ]

    @property
    def model_map(self) -> ModelMap:
        """The roles discovery found (`stabkit.inspect_model`). Before the first forward, for a model that
        discovery waits for, raises RuntimeError."""
        if self._model_map is None:
            raise RuntimeError(
                "stabkit: discovery waits for the model's first forward (stabkit cannot make an example "
                "input for this model); run a forward first, or pass attach(..., example=inputs)"
            )
        return self._model_map

    def _discover_on_first_forward(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        """Forward pre-hook on every module, until the model's own forward runs: trace it on these
        inputs (RNG and buffers restored), then finish attaching before the forward itself runs, so
        this step is monitored too. A submodule called on its own first (``model.wte(x)`` before
        ``model(e)``) is not the model's forward: discovery waits. A wrapper whose own forward never
        runs (a LightningModule calling ``self.model``) is traced at the submodule holding most of
        the parameters."""
        if module is not self.model and not _holds_most(module, self.model):
            return
        for handle in self._pending or []:
            handle.remove()
        self._pending = None
        try:
            try:
                traced_map(self.model, (tuple(args), dict(kwargs)), self._pending_paths[id(module)])
            except Exception:  # the trace itself failed: `_discover` falls back to names or a minimal map
                if self.config.strict:
                    raise
            self._finish_attach(None, None, self._interventions_spec)
        except BaseException:  # strict mode (or a user error): nothing stays attached
            self._detached = True
            self.sinks.close()
            lifecycle.unregister(self)
            raise

    def _finish_attach(
        self, model_map: ModelMap | dict[str, Any] | None, example: Any, interventions: Any
    ) -> None:
        """Discovery, interventions, probes, detectors and the audit: at attach, or at the first forward."""
        model = self.model
        self.interventions = self._apply_interventions(interventions, model_map, example)
        try:
            self._model_map = self._discover(model_map, example)
        except BaseException:
            if self.interventions is not None:
                self.interventions.remove()
            raise
        cfg = self.config
        self.context = ProbeContext(
            model,
            self.model_map,
            self.optimizer,
            self.recorder,
            cfg,
            lambda: self._step,
            self.facts,
            self.hooks,
        )
        self.probes = build_probes(cfg)
        self._ending = [p for p in self.probes if type(p).end_step is not Probe.end_step]
        self._finishing = [p for p in self.probes if type(p).finish_rows is not Probe.finish_rows]
        try:
            for probe in self.probes:
                probe.attach(self.context)
            detect = cfg.detect
            if detect is None and self.scaler is not None and self.scaler.is_enabled():
                # the fp16 overflow report comes with attach(..., scaler=...), detectors or not
                detect = DetectConfig(detectors=("amp",))
            self.detectors = self.install_detectors(detect) if detect is not None else None
        except BaseException:
            self._remove_hooks()
            if self.interventions is not None:
                self.interventions.remove()
            raise
        self.sinks.write_text("stabkit/model_map", "```\n" + self.model_map.describe() + "\n```")
        if self.interventions is not None:
            self.sinks.write_text("stabkit/interventions", ", ".join(self.interventions.names))
        self.audit_report = self._run_audit() if cfg.audit else None

    def _discover(self, model_map: ModelMap | dict[str, Any] | None, example: Any) -> ModelMap:
        """The model's map. Hints the user gave must hold (a bad hint raises); discovery on its own
        never stops the run: what it cannot find is said once and the rest is monitored (a map with
        no blocks at worst), unless `MonitorConfig.strict`."""
        strict = self.config.strict
        if model_map is not None:
            return inspect_model(self.model, model_map, example=example)
        try:
            return inspect_model(self.model, example=example, strict=strict)
        except DiscoveryError as exc:
            if strict:
                raise
            mmap = logits_only(self.model, example) or ModelMap(family="none", blocks=[])
            mmap.gaps = [f"no Transformer roles found ({exc})"]
            report_gaps(self.model, mmap)
            return mmap

    def install_detectors(self, config: DetectConfig | None = None) -> Decisions:
        """Attach detectors and actions (after the probes; `attach` does it from `MonitorConfig.detect`).
        Replaces detectors installed before."""
        if self.detectors is not None:
            self.detectors.remove()
        wiring = Wiring(
            model=self.model,
            optimizer=self.optimizer,
            model_map=self.model_map,
            recorder=self.recorder,
            hooks=self.hooks,
            step=lambda: self._step,
            report=self.report,
            muted=self._muted,
            logdir=self.logdir,
            metrics=self._metrics,
            sampled_every=self.config.every,
            deep_every=self.config.deep_cadence,
            distributed=self.dist.active,
            facts=self.facts,
            warmup_steps=self.schedule["warmup_steps"],
        )
        self.detectors = Decisions(wiring, config or DetectConfig())
        return self.detectors

    @contextlib.contextmanager
    def _muted(self) -> Iterator[None]:
        """While active, the probes record into a throwaway Recorder (a replay's statistics go nowhere)."""
        saved = self.context.recorder
        self.context.recorder = Recorder()
        try:
            yield
        finally:
            self.context.recorder = saved

    def describe_hooks(self) -> str:
        """Every hook stabkit registered on the model and optimizer, in registration order."""
        return "\n".join(self.hooks.describe())

    def _apply_interventions(
        self, specs: InterventionSpecs | None, model_map: Any = None, example: Any = None
    ) -> Handle | None:
        """Switch on the requested interventions before discovery; new gains join the optimizer
        as their own parameter group (no weight decay)."""
        if not specs:
            return None
        from .interventions import apply_many

        if example is not None and model_map is None:
            inspect_model(self.model, example=example)  # trace once now: the interventions reuse the map
        handle = apply_many(self.model, specs, model_map, example)
        from .interventions import join_optimizer

        group = join_optimizer(handle, self.optimizer)
        if group is not None:
            handle.on_remove(lambda: self._drop_group(group))
        return handle

    def _drop_group(self, group: dict[str, Any]) -> None:
        """At detach: take the interventions' parameter group (and its state) out of the optimizer."""
        opt = self.optimizer
        if opt is None:
            return
        for p in group["params"]:
            opt.state.pop(p, None)
        if isinstance(opt, OptimizerSet):
            opt.remove_param_group(group)
        else:
            opt.param_groups[:] = [g for g in opt.param_groups if g is not group]

    def _run_audit(self) -> Any:
        """The architecture audit, once at attach: to TensorBoard as text and to the JSONL log."""
        from .audit import audit

        try:
            report = audit(self.model, self.optimizer, model_map=self.model_map, **self.schedule)
        except Exception as exc:  # the audit must never stop training
            warnings.warn(
                f"stabkit: the audit failed ({type(exc).__name__}: {exc}); continuing", stacklevel=3
            )
            return None
        self.sinks.write_text("stabkit/audit", report.to_markdown())
        self.sinks.write_record("audit", report.to_dict())
        return report

    @property
    def metrics(self) -> dict[str, float]:
        """Newest host value of every metric, as of the last `step()` (per-layer ones from the last
        sampled step). Reading it copies the steps not yet written out to the host (one transfer,
        `Recorder.peek`): only when read, so a loop that never reads it keeps one host copy per log
        interval. Under torch.distributed it holds the reduced values of the last log interval."""
        if not self.dist.active and self.recorder.pending_steps > self._peeked:
            for _, values in self.recorder.peek(self._peeked):
                self._metrics.update(values)
            self._peeked = self.recorder.pending_steps
        return self._metrics

    @property
    def global_step(self) -> int:
        """Number of completed steps (the index the next `step()` call will commit)."""
        return self._step

    def step(self, loss: torch.Tensor | float | None = None) -> None:
        """Close one training step. Call after `optimizer.step()` and before the next `zero_grad()`.

        With gradient accumulation call it once per optimizer step (not per micro-batch).
        Costs no host sync except once per `log_every` steps.
        """
        if self._detached:
            raise RuntimeError("Monitor.step() called after detach(); attach again to keep monitoring")
        if isinstance(loss, torch.Tensor) and loss.numel() != 1:
            raise ValueError(
                f"Monitor.step(loss): pass a scalar loss (e.g. loss.mean()), got a tensor of shape {tuple(loss.shape)}"
            )
        if loss is not None and not isinstance(loss, torch.Tensor):
            accepts = "Monitor.step(loss): `loss` must be a scalar tensor, a real number (int, float, NumPy scalar) or None"
            if isinstance(loss, str | bytes):  # float('2.5') would pass: text is never a loss
                raise TypeError(f"{accepts}, got {type(loss).__name__} {loss!r}")
            try:
                loss = float(loss)
            except (TypeError, ValueError) as exc:
                raise TypeError(f"{accepts}, got {type(loss).__name__} {loss!r}") from exc
        if loss is not None and "loss" in self.config.families:
            if isinstance(loss, torch.Tensor):
                value = loss.detach()
                value = value if value.dim() == 0 else value.reshape(())
            else:
                value = torch.tensor(float(loss), device=self._device)
            self.recorder.add("loss", value)
        if self.interventions is not None:
            for name, value in self.interventions.metrics().items():
                self.recorder.add(name, value)
        if isinstance(self.optimizer, OptimizerSet):
            self.optimizer.end_step()  # a post-step hook still due (an optimizer that did not step) runs now
        for probe in self._ending:
            probe.end_step()
        committed = self.recorder.commit(self._step)
        try:
            if self.detectors is not None and not self.detectors.removed:
                self.detectors.on_step(self._step, committed)
        finally:  # an action may raise InstabilityError: the step still counts and logs still flush
            self._step += 1
            self._refresh_phase()
            flush_hook_warnings()
            if self._step % self.config.log_every == 0 or self.flush_every_step:
                self.flush()

    def _refresh_phase(self) -> None:
        """The step count changed: the probes' sampling decision follows (`ProbeContext.refresh`), and
        so do which of their hooks are on the model (`stabkit.hook_parking`)."""
        context: ProbeContext | None = getattr(self, "context", None)
        if context is not None:
            context.refresh()
        self.hooks.parking.follow(self._step)

    def flush(self) -> None:
        """Copy pending statistics to the host (one transfer) and write them to every sink."""
        rows = self.recorder.drain()
        if self.dist.sharded:
            finish_ratios(rows)
        for probe in self._finishing:
            probe.finish_rows(rows)
        if self.detectors is not None and not self.detectors.removed:
            self.detectors.on_rows(rows)
        self._peeked = 0
        if rows:
            for _, values in rows:
                self._metrics.update(values)
            self.history.extend(rows)
            self.sinks.write_rows(rows)
        self.sinks.flush()

    def state_dict(self) -> dict[str, Any]:
        """What to save with a checkpoint: the step count and the detectors' state."""
        return {
            "step": self._step,
            "detectors": self.detectors.state_dict() if self.detectors is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output (e.g. when resuming from a checkpoint)."""
        self._step = int(state.get("step", self._step))
        self._refresh_phase()
        if self.detectors is not None and state.get("detectors"):
            self.detectors.load_state_dict(state["detectors"])

    def report(self, event: Event) -> None:
        """Record an event, file it into its incident (`stabkit.incidents`) and write both out at once
        (sinks flush on every event)."""
        self.events.append(event)
        incident, _ = self.incidents.file(event)
        self.sinks.write_event(event)
        self.sinks.write_record("incident", incident.to_dict())

    def write_text(self, tag: str, text: str) -> None:
        """Write a text note (e.g. an audit report) to the sinks."""
        self.sinks.write_text(tag, text, self._step)

    def detach(self) -> None:
        """Remove every hook stabkit added, flush and close the sinks. Safe to call twice."""
        if self._detached:
            return
        self._detached = True
        try:
            self.flush()
        finally:
            self._remove_hooks()
            if self.interventions is not None:
                self.interventions.remove()
            if isinstance(self.optimizer, OptimizerSet):
                self.optimizer.remove()
            forget_compiled_code(warn=False)  # compiled code must not keep calling removed hooks
            context: ProbeContext | None = getattr(self, "context", None)
            if context is not None:
                context.close()
            self.sinks.close()
            lifecycle.unregister(self)

    def close_on_crash(self) -> None:
        """Called at interpreter exit or on SIGTERM: flush what completed steps recorded, then detach."""
        self._local_only()
        self.detach()

    def _local_only(self) -> None:
        """Ending abnormally under torch.distributed: no collectives (other ranks may be gone); rank 0
        writes its own last values."""
        if self.dist.active and self.recorder.reducer is not None:
            self.recorder.reducer = None
            if self.recorder.pending_steps:
                self.sinks.write_text(
                    "stabkit/distributed",
                    f"the last {self.recorder.pending_steps} step(s) are rank {self.dist.rank}'s own values "
                    "(not reduced across ranks): the run ended abnormally",
                    self._step,
                )

    def _remove_hooks(self) -> None:
        self._pending = None
        if self.detectors is not None:
            self.detectors.remove()
        for probe in self.probes:
            probe.detach()
        self.hooks.remove()  # everything else (input guard, discovery's first-forward hooks, integrations)

    def __enter__(self) -> Monitor:
        return self

    def __repr__(self) -> str:
        """State, step, logdir, what is watched, the newest loss / grad norm / log Z and the newest
        events with their severity (`stabkit.monitor_repr`; reading the newest values is a host copy)."""
        from .monitor_repr import text

        return text(self)

    def _repr_html_(self) -> str:
        """The same as `__repr__`, as an HTML table (a notebook cell's value)."""
        from .monitor_repr import to_html

        return to_html(self)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is not None and not isinstance(exc, InstabilityError):
            self._local_only()  # InstabilityError comes from an agreed decision: every rank raises it
        self.detach()


def _holds_most(module: nn.Module, model: nn.Module) -> bool:
    """True when `module` holds at least half of `model`'s parameters (the wrapped model of a wrapper)."""
    total = sum(p.numel() for p in model.parameters())
    return total > 0 and 2 * sum(p.numel() for p in module.parameters()) >= total
