"""Spike detection on host values of the loss, gradient norms and update ratios, and the OLMo 2 spike score.

Runs when the detectors consume a value: at the log interval (warn only) or every step (when an
action for 'spike' needs a decision). Pure and checkpointable; never touches tensors.

The rule, per series, over the previous `window` values (`SpikeOptions`, ``DetectConfig.options
["spike"]``; the new value is judged against history it is not part of):

    spike  ⇔  n ≥ min_history  and  x ≥ level + sigma · σ_noise  and  x ≥ min_ratio · level
           or  n ≥ min_history  and  x ≥ factor · level

- **level** is the median of the newest `recent` (16) values: the run's recent trend. A 128-value
  median still holds the steep early descent of the loss — on the tiny reference GPT a loss × 20 at
  step 140 (0.08 → 1.6) stayed under a threshold of the old window's median; the recent median
  follows the descent within ~8 steps and catches it, and a spike can be judged after `min_history`
  (8) values, not half a window.
- **σ_noise** is the robust scatter of the window's successive differences (1.4826·MAD/√2: the
  trend taken out, so a steady descent does not widen it, and one spike in the window cannot
  inflate it and hide the next one), or the robust scatter of the `recent` values around the level
  when that is larger (`RollingWindow.recent_level_noise`).
- window 128 and 6σ are OLMo's (StabilityMonitor / SkipStepOptimizer: mean + 6σ over 128 steps).
- Series of an *update* (``update/*``) are divided by the optimizer's learning rate of the step
  (``opt/lr``, `stabkit.learning_rate`) before they are judged: a warmup ramp or a schedule's
  drop changes the update, not the run.
- `min_ratio` guards against the heavy tails of small-batch runs. Measured on the tiny reference
  GPT (2000 steps, AdamW 1e-3..3e-3, 64–1024 tokens per batch): stable runs reach 6–25 robust σ
  with the gradient norm at 2.1–4.8× its median and the loss at up to 1.9× (one hard batch);
  unstable runs (LR 3e-2, 1e-1) jump 9–320×. Defaults: loss 1.5× (Composer's KillLossSpike and
  Lightning Fabric use 2×), gradient norms 5×, update ratios 2×.
- `factor` 10× is Megatron's large-loss / large-grad check (value ≥ 10× its reference): a
  gross jump is a spike even when the window is too noisy for σ to say so. (For positive series
  median + 6·1.4826·MAD ≤ 9.9× the median, so at the defaults it matters only when the min
  ratio or sigma is raised.)
- Only upward spikes count (a sudden *drop* of loss or norm is not an instability).
- Severity: a loss spike is a 'warning'; a gradient-norm or update spike alone is a note ('info',
  `SpikeOptions.warn`): healthy runs have them (5–30× on the embeddings' and first blocks' gradients
  in the alarm corpus) and clipping absorbs them. One cause makes one incident (`stabkit.incidents`):
  a bad batch's gradient spike and its loss spike together are a warning. The actions act on
  warnings by default; a variant that skips every spiking update (OLMo's skip-step) sets
  ``DetectConfig(act_on="info")``.

The spike score (`spike/<series>/score`) is OLMo 2's (§3.2): the percentage of values at least
`score_sigma` (7) standard deviations from the mean of the previous `score_window` (1000) values,
cumulative over the run; values are scored once `min_history` values precede them.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..events import Event
from ..learning_rate import LR_SERIES
from ..metric_names import GRAD, UPDATE, parse
from ..plugins import DETECTORS
from ..tables import bounds
from .advice import Advice
from .base import Detector, DetectorContext, Observation
from .rolling import RollingWindow


def _default_min_ratio() -> dict[str, float]:
    return {"loss": 1.5, "grad/*": 5.0, "update/*": 2.0, "*": 1.0}


@dataclass(frozen=True)
class SpikeOptions:
    """``DetectConfig.options["spike"]``."""

    series: tuple[str, ...] = ("loss", "grad/global_norm", "grad/*/norm", "update/*/ratio")
    """Globs of the metrics the spike detector watches."""
    window: int = field(default=128, metadata=bounds(lo=1))
    """Values of each series in the rolling window (OLMo's StabilityMonitor: 128 steps)."""
    sigma: float = field(default=6.0, metadata=bounds(lo=0, lo_open=True))
    """A spike is at least this many robust standard deviations above the rolling median (OLMo: mean + 6σ)."""
    min_ratio: dict[str, float] = field(default_factory=_default_min_ratio, metadata=bounds(lo=1))
    """Glob -> the value must also be at least this multiple of the rolling median (first matching glob wins)."""
    factor: float | None = field(default=10.0, metadata=bounds(lo=1, lo_open=True))
    """A value at least this multiple of the rolling median is a spike whatever σ says (Megatron: 10×); None = off."""
    min_history: int = field(default=8, metadata=bounds(lo=2))
    """Values a series needs before it can spike (the level needs a few values; the noise estimate
    grows with the window)."""
    recent: int = field(default=16, metadata=bounds(lo=1))
    """Newest values whose median is the level a new value is judged against (the run's recent trend)."""
    per_lr: tuple[str, ...] = ("update/*",)
    """Globs of the series divided by the step's learning rate (``opt/lr``) before they are judged."""
    warn: tuple[str, ...] = ("loss",)
    """Globs of the series whose spike is a 'warning'; a spike of any other series (gradient norms,
    update ratios) is a note ('info'), and its incident becomes a warning when the loss spikes with it.
    Healthy runs of the alarm corpus spike their gradient norms 5–30× (embeddings, the first blocks,
    the end of a warmup) while the loss falls on; what harms a run shows in its loss."""
    score_window: int = field(default=1000, metadata=bounds(lo=1))
    """OLMo 2 spike score: values in the rolling mean/std window."""
    score_sigma: float = field(default=7.0, metadata=bounds(lo=0, lo_open=True))
    """OLMo 2 spike score: distance from the rolling mean, in standard deviations, that counts as a spike."""

    def min_ratio_of(self, series: str) -> float:
        """The minimum multiple of the rolling median a spike of `series` must reach."""
        for pattern, ratio in self.min_ratio.items():
            if fnmatch.fnmatchcase(series, pattern):
                return float(ratio)
        return 1.0


@dataclass
class SeriesState:
    """Rolling windows and spike-score counters of one series."""

    window: RollingWindow
    score_window: RollingWindow
    scored: int = 0
    flagged: int = 0
    steps: list[int] = field(default_factory=list)
    """Steps of the values pushed since the last rewind (newest last; kept as long as the score
    window), so that a rollback can take back exactly the values of the steps it undid."""

    @property
    def score(self) -> float:
        """OLMo 2 spike score in percent (0 before any value was scored)."""
        return 100.0 * self.flagged / self.scored if self.scored else 0.0


@DETECTORS.register
class SpikeDetector(Detector):
    """Per-series spike rule and spike score for every metric matching `SpikeOptions.series`."""

    kind = "spike"
    options_class = SpikeOptions
    before_update = ("grad/*",)
    advice: ClassVar[dict[str, Advice]] = {
        "early_grad_blowup_post": Advice(
            "gradient-norm spike in an early block of a post-norm model",
            ("norm_placement",),
            "post-norm gradients near the input are large at init (Xiong et al. 2020): switch to pre or sandwich norm, or lengthen warmup",
        ),
        "grad_spike": Advice(
            "gradient-norm spike",
            (),
            "clip the gradient norm (1.0), lower the peak learning rate or lengthen warmup; spikes from the embeddings: no weight decay on them (OLMo 2)",
        ),
        "update_spike": Advice(
            "update/parameter ratio spike",
            (),
            "lower the learning rate or lengthen warmup; check Adam ε (1e-8; Wortsman et al. 2023 §3.4); update spikes precede loss spikes (marin#1368)",
        ),
        "loss_spike": Advice(
            "loss spike",
            (),
            "PaLM: restart ~100 steps earlier and skip 200–500 batches (action 'rollback'); the grad-norm and update-ratio events just before it name the layer",
        ),
    }

    def __init__(self, ctx: DetectorContext) -> None:
        super().__init__(ctx)
        self.options = ctx.options(self.kind, SpikeOptions)
        self._warns: dict[str, bool] = {}
        self.watches = (*self.options.series, LR_SERIES)  # type: ignore[misc]
        self.series: dict[str, SeriesState] = {}
        self._per_lr: dict[str, bool] = {}

    def per_lr(self, name: str) -> bool:
        """True when series `name` is judged per unit of learning rate (`SpikeOptions.per_lr`)."""
        hit = self._per_lr.get(name)
        if hit is None:
            hit = self._per_lr[name] = any(fnmatch.fnmatchcase(name, p) for p in self.options.per_lr)
        return hit

    def severity_of(self, name: str) -> str:
        """'warning' for a series matching `SpikeOptions.warn`, else 'info' (cached per name)."""
        hit = self._warns.get(name)
        if hit is None:
            hit = self._warns[name] = any(fnmatch.fnmatchcase(name, p) for p in self.options.warn)
        return "warning" if hit else "info"

    def rate_free(self, name: str, x: float, lr: float | None) -> float | None:
        """`x` as judged: divided by the step's learning rate for an update series (None: not judged,
        a zero rate — the first step of a warmup from 0)."""
        if lr is None or not self.per_lr(name):
            return x
        return x / lr if lr > 0 else None

    def observe(self, step: int, values: Mapping[str, float]) -> Observation:
        """Each value: a spike event and/or its spike score (``spike/<series>/score``)."""
        seen = Observation()
        for name, event, score in self.judged(step, values):
            if score is not None:
                seen.series[f"spike/{name}/score"] = score
            if event is not None:
                seen.events.append(event)
        return seen

    def judged(
        self, step: int, values: Mapping[str, float]
    ) -> Iterator[tuple[str, Event | None, float | None]]:
        """(name, spike event or None, score or None) of each watched value of `step`, an update series
        judged per unit of the step's learning rate (``opt/lr``, itself not judged; its event keeps the
        raw value and says so)."""
        lr = values.get(LR_SERIES)
        for name, raw in values.items():
            x = None if name == LR_SERIES else self.rate_free(name, raw, lr)
            if x is None:
                continue
            event, score = self.update(step, name, x)
            if event is not None and x != raw:
                event.value = raw
                event.details["lr"] = lr
                event.message += f" (per unit of learning rate; lr {lr:.3g})"
            yield name, event, score

    def signature(self, event: Event) -> str:
        """update_spike / grad_spike (early_grad_blowup_post in an early post-norm block) / loss_spike."""
        name = event.where
        parsed = parse(name)
        if parsed is not None and parsed.family == UPDATE:
            return "update_spike"
        if parsed is not None and parsed.family == GRAD:
            block = self.ctx.block_of(parsed.path)
            early = block is not None and block.index < max(1, len(self.ctx.blocks) // 2)
            return (
                "early_grad_blowup_post"
                if early and block is not None and block.placement == "post"
                else "grad_spike"
            )
        return "loss_spike"

    def update(self, step: int, name: str, x: float) -> tuple[Event | None, float | None]:
        """Consume value `x` of series `name` at `step`: (spike event or None, spike score or None).

        Non-finite values are ignored here (the non-finite detector reports them).
        """
        if not math.isfinite(x):
            return None, None
        o = self.options
        state = self.series.get(name)
        if state is None:
            state = SeriesState(RollingWindow(o.window), RollingWindow(o.score_window))
            self.series[name] = state
        event = self._judge(step, name, x, state)
        score = None
        if len(state.score_window) >= o.min_history:
            mean, std = state.score_window.mean_std()
            state.scored += 1
            if abs(x - mean) >= o.score_sigma * std and std > 0:
                state.flagged += 1
            score = state.score
        state.window.push(x)
        state.score_window.push(x)
        state.steps.append(step)
        if len(state.steps) > 2 * max(o.window, o.score_window):
            del state.steps[: -max(o.window, o.score_window)]
        return event, score

    def rewind(self, step: int) -> None:
        """Take back every value pushed at `step` or later from the windows (the rolled-back steps'
        losses and norms describe a trajectory that no longer exists)."""
        for state in self.series.values():
            n = sum(1 for s in state.steps if s >= step)
            if n:
                state.window.drop_newest(n)
                state.score_window.drop_newest(n)
                del state.steps[-n:]

    def _judge(self, step: int, name: str, x: float, state: SeriesState) -> Event | None:
        o = self.options
        if len(state.window) < o.min_history:
            return None
        med, sigma = state.window.recent_level_noise(o.recent)
        if med <= 0 or x <= med:
            return None
        threshold = max(med + o.sigma * sigma, o.min_ratio_of(name) * med)
        factor_line = o.factor * med if o.factor is not None else math.inf
        if x < threshold and x < factor_line:
            return None
        z = (x - med) / sigma if sigma > 0 else math.inf
        crossed = threshold if x >= threshold else factor_line
        rule = f"{z:.1f}σ of step-to-step noise above it" if x >= threshold else f"≥ {o.factor:g}× it"
        return Event(
            step=step,
            kind="spike",
            where=name,
            value=x,
            threshold=crossed,
            message=(
                f"{name} = {x:.4g} is {x / med:.1f}× its recent level {med:.4g} (median of the last "
                f"{min(o.recent, len(state.window))} values; {rule}; threshold {crossed:.4g})"
            ),
            details={
                "series": name,
                "median": med,
                "sigma": sigma,
                "z": z if math.isfinite(z) else None,
                "ratio": x / med,
                "window": len(state.window),
                "recent": min(o.recent, len(state.window)),
            },
            severity=self.severity_of(name),
        )

    def state_dict(self) -> dict[str, Any]:
        """Plain state of every series (windows and score counters)."""
        return {
            name: {
                "window": s.window.state_dict(),
                "score_window": s.score_window.state_dict(),
                "scored": s.scored,
                "flagged": s.flagged,
            }
            for name, s in self.series.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()` output."""
        o = self.options
        self.series = {}
        for name, s in state.items():
            series = SeriesState(RollingWindow(o.window), RollingWindow(o.score_window))
            series.window.load_state_dict(s["window"])
            series.score_window.load_state_dict(s["score_window"])
            series.scored, series.flagged = int(s["scored"]), int(s["flagged"])
            self.series[name] = series
