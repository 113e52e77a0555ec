"""Train one corpus config in this process exactly as a new user would, and keep what stabkit said.

The loop: ``mon = stabkit.attach(model, optimizer, logdir=..., config=...)`` with nothing else passed
(no learning rate, no warmup), then per optimizer step: zero grads, `accum` micro-batches (forward
under bf16 autocast when the config says so; a mixture of experts' balancing loss added to the
cross-entropy, `families.outputs_of`; ``(loss / accum).backward()``), optional clipping,
``optimizer.step()``, ``mon.step(loss)``, ``scheduler.step()``; ``mon.detach()`` at the end.

Planted spikes (`Spike`): at a chosen step every micro-batch's loss is multiplied by a factor before
backward, so the gradients scale with it, as a bad batch does. A spike is *found* when an event of
severity ``warning`` or above lands within `SPIKE_TOLERANCE` steps after it (`stats.spike_found`).
"""

from __future__ import annotations

import contextlib
import io
import math
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .corpus import HealthyConfig
from .families import build_model, outputs_of
from .inits import apply_init
from .optim import make_optimizers, make_schedulers

ZIPF_VOCAB = 512


@dataclass(frozen=True)
class Spike:
    """A planted loss spike: the loss of optimizer step `step` is multiplied by `factor` before backward."""

    step: int
    factor: float


@dataclass
class RunOutcome:
    """What one corpus run left: stabkit's events and the losses (plain data, JSON-ready)."""

    name: str
    steps: int
    monitor: str
    events: list[dict[str, Any]] = field(default_factory=list)
    """Each: step, kind, severity, where, message, value, threshold, details."""
    losses: list[float] = field(default_factory=list)
    """The loss passed to `mon.step` each step (planted spikes included)."""
    spikes: list[list[float]] = field(default_factory=list)
    """Planted spikes as [step, factor]."""
    wall_s: float = 0.0
    error: str = ""
    """Empty when the run finished; else the exception, one line."""

    @property
    def first_loss(self) -> float:
        return self.losses[0] if self.losses else math.nan

    @property
    def last_loss(self) -> float:
        """Mean of the last 10 losses (the end of a healthy run, not one batch's noise)."""
        tail = self.losses[-10:]
        return sum(tail) / len(tail) if tail else math.nan

    @property
    def max_jump(self) -> float:
        """The largest ratio of a step's loss to the median of the 10 before it (planted steps left
        out): how smooth the curve is (a healthy run stays near 1; a real loss spike is well above)."""
        planted = {int(s) for s, _ in self.spikes}
        worst = math.nan
        for i in range(10, len(self.losses)):
            if i in planted:
                continue
            before = sorted(v for j, v in enumerate(self.losses[i - 10 : i], i - 10) if j not in planted)
            if before and math.isfinite(self.losses[i]):
                ratio = self.losses[i] / before[len(before) // 2]
                worst = ratio if not ratio <= worst else worst
        return worst

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["first_loss"], out["last_loss"], out["max_jump"] = self.first_loss, self.last_loss, self.max_jump
        return out


def _data(cfg: HealthyConfig) -> Any:
    from ..data import SyntheticSpec, load_corpus

    if cfg.data == "zipf":
        return load_corpus(SyntheticSpec(vocab=ZIPF_VOCAB, tokens=200_000, clusters=32, seed=0))
    return load_corpus()


def _monitor_config(mode: str) -> Any:
    from ...config import MonitorConfig

    return MonitorConfig.full() if mode == "full" else MonitorConfig()


def event_dict(event: Any) -> dict[str, Any]:
    """An `Event` as the plain dict a result keeps."""
    return {
        "step": int(event.step),
        "kind": str(event.kind),
        "severity": str(getattr(event, "severity", "warning")),
        "where": str(event.where),
        "message": str(event.message),
        "value": float(event.value),
        "threshold": float(event.threshold),
        "details": _plain(event.details),
    }


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


def run_config(
    cfg: HealthyConfig,
    steps: int | None = None,
    spikes: Sequence[Spike] = (),
    monitor: str | None = None,
    logdir: str | None = None,
    quiet: bool = True,
) -> RunOutcome:
    """Train `cfg` (for `steps` instead of its own, warmup scaled alike) under `stabkit.attach` and
    return its events and losses. `monitor` overrides the config's monitor mode. `quiet` keeps the
    console sink's lines out of this process's stdout/stderr. Errors are kept in the outcome."""
    import stabkit

    if steps is not None and steps != cfg.steps:
        cfg = cfg.with_steps(steps)
    mode = monitor or cfg.monitor
    out = RunOutcome(cfg.name, cfg.steps, mode, spikes=[[s.step, s.factor] for s in spikes])
    factors = {s.step: s.factor for s in spikes}
    start = time.perf_counter()
    sink = io.StringIO()
    with contextlib.ExitStack() as stack:
        tmp = logdir or stack.enter_context(tempfile.TemporaryDirectory(prefix="stabkit-alarms-"))
        if quiet:
            stack.enter_context(contextlib.redirect_stdout(sink))
            stack.enter_context(contextlib.redirect_stderr(sink))
        torch.manual_seed(cfg.seed)
        data = _data(cfg)
        model = build_model(
            cfg.family, data.vocab if hasattr(data, "vocab") else 256, cfg.seq, cfg.width, cfg.depth,
            cfg.heads, cfg.kv_heads or cfg.heads, cfg.placement,
        )  # fmt: skip
        apply_init(model, cfg.init, cfg.depth)
        opts = make_optimizers(
            model, cfg.optimizer, cfg.lr, cfg.muon_lr, cfg.width if cfg.init == "mup" else None
        )
        scheds = make_schedulers(opts, cfg.schedule, cfg.steps, cfg.warmup)
        mon = stabkit.attach(
            model, opts[0] if len(opts) == 1 else opts, logdir=tmp, config=_monitor_config(mode)
        )
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        try:
            _train(cfg, model, opts, scheds, mon, data, gen, factors, out.losses)
        except Exception as exc:  # kept in the outcome: one broken config does not end the corpus
            out.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        finally:
            mon.detach()
        out.events = [event_dict(e) for e in mon.events]
    out.wall_s = time.perf_counter() - start
    return out


def _train(
    cfg: HealthyConfig,
    model: torch.nn.Module,
    opts: list[torch.optim.Optimizer],
    scheds: list[Any],
    mon: Any,
    data: Any,
    gen: torch.Generator,
    factors: dict[int, float],
    losses: list[float],
) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(cfg.steps):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for _ in range(cfg.accum):
            x, y = data.batch("train", cfg.batch, cfg.seq, gen)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
                logits, aux = outputs_of(model, x)
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            if aux is not None:  # a mixture of experts' balancing loss, as its real runs train
                loss = loss + aux.float()
            if step in factors:
                loss = loss * factors[step]
            (loss / cfg.accum).backward()
            total += loss.detach() / cfg.accum
        if cfg.clip is not None:
            torch.nn.utils.clip_grad_norm_(params, cfg.clip)
        for opt in opts:
            opt.step()
        mon.step(total)
        for sched in scheds:
            sched.step()
        losses.append(float(total))
