"""Spike detection on host values of the loss, gradient norms and update ratios, and the OLMo 2 spike score.

Runs when the detectors consume a value: at the log interval (warn only) or every step (when an
action for 'spike' needs a decision). Pure and checkpointable; never touches tensors.

The rule, per series, over the previous `spike_window` values (the new value is judged against
history it is not part of):

    spike  ⇔  n ≥ spike_min_history  and  x ≥ median + spike_sigma · σ_robust  and  x ≥ min_ratio · median
           or  n ≥ spike_min_history  and  x ≥ spike_factor · median

- window 128 and 6σ are OLMo's (StabilityMonitor / SkipStepOptimizer: mean + 6σ over 128 steps).
  The median and σ_robust = 1.4826·MAD replace OLMo's mean and std so that one spike in the
  window cannot inflate σ and hide the next one.
- `min_ratio` guards against the heavy tails of small-batch runs. Measured on the tiny reference
  GPT (2000 steps, AdamW 1e-3..3e-3, 64–1024 tokens per batch): stable runs reach 6–25 robust σ
  with the gradient norm at 2.1–4.8× its median and the loss at up to 1.9× (one hard batch);
  unstable runs (LR 3e-2, 1e-1) jump 9–320×. Defaults: loss 1.5× (Composer's KillLossSpike and
  Lightning Fabric use 2×), gradient norms 5×, update ratios 2×.
- `spike_factor` 10× is Megatron's large-loss / large-grad check (value ≥ 10× its reference): a
  gross jump is a spike even when the window is too noisy for σ to say so. (For positive series
  median + 6·1.4826·MAD ≤ 9.9× the median, so at the defaults it matters only when the min
  ratio or spike_sigma is raised.)
- Only upward spikes count (a sudden *drop* of loss or norm is not an instability).

The spike score (`spike/<series>/score`) is OLMo 2's (§3.2): the percentage of values at least
`score_sigma` (7) standard deviations from the mean of the previous `score_window` (1000) values,
cumulative over the run; values are scored once `spike_min_history` values precede them.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any

from ..events import Event
from .config import DetectConfig
from .rolling import RollingWindow


@dataclass
class SeriesState:
    """Rolling windows and spike-score counters of one series."""

    window: RollingWindow
    score_window: RollingWindow
    scored: int = 0
    flagged: int = 0

    @property
    def score(self) -> float:
        """OLMo 2 spike score in percent (0 before any value was scored)."""
        return 100.0 * self.flagged / self.scored if self.scored else 0.0


class SpikeDetector:
    """Per-series spike rule and spike score for every metric matching `DetectConfig.spike_series`."""

    def __init__(self, config: DetectConfig) -> None:
        self.config = config
        self.series: dict[str, SeriesState] = {}
        self._wants: dict[str, bool] = {}

    def wants(self, name: str) -> bool:
        """True when `name` is a series this detector watches."""
        hit = self._wants.get(name)
        if hit is None:
            hit = any(fnmatch.fnmatchcase(name, p) for p in self.config.spike_series)
            self._wants[name] = hit
        return hit

    def update(self, step: int, name: str, x: float) -> tuple[Event | None, float | None]:
        """Consume value `x` of series `name` at `step`: (spike event or None, spike score or None).

        Non-finite values are ignored here (the non-finite detector reports them).
        """
        if not math.isfinite(x):
            return None, None
        cfg = self.config
        state = self.series.get(name)
        if state is None:
            state = SeriesState(RollingWindow(cfg.spike_window), RollingWindow(cfg.score_window))
            self.series[name] = state
        event = self._judge(step, name, x, state)
        score = None
        if len(state.score_window) >= cfg.spike_min_history:
            mean, std = state.score_window.mean_std()
            state.scored += 1
            if abs(x - mean) >= cfg.score_sigma * std and std > 0:
                state.flagged += 1
            score = state.score
        state.window.push(x)
        state.score_window.push(x)
        return event, score

    def _judge(self, step: int, name: str, x: float, state: SeriesState) -> Event | None:
        cfg = self.config
        if len(state.window) < cfg.spike_min_history:
            return None
        med, sigma = state.window.median_sigma()
        if med <= 0 or x <= med:
            return None
        threshold = max(med + cfg.spike_sigma * sigma, cfg.min_ratio(name) * med)
        factor_line = cfg.spike_factor * med if cfg.spike_factor is not None else math.inf
        if x < threshold and x < factor_line:
            return None
        z = (x - med) / sigma if sigma > 0 else math.inf
        crossed = threshold if x >= threshold else factor_line
        rule = f"{z:.1f}σ above the median" if x >= threshold else f"≥ {cfg.spike_factor:g}× the median"
        return Event(
            step=step,
            kind="spike",
            where=name,
            value=x,
            threshold=crossed,
            message=(
                f"{name} = {x:.4g} is {x / med:.1f}× its rolling median {med:.4g} ({rule}, "
                f"window {len(state.window)})"
            ),
            details={
                "series": name,
                "median": med,
                "sigma": sigma,
                "z": z if math.isfinite(z) else None,
                "ratio": x / med,
                "window": len(state.window),
            },
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
        cfg = self.config
        self.series = {}
        for name, s in state.items():
            series = SeriesState(RollingWindow(cfg.spike_window), RollingWindow(cfg.score_window))
            series.window.load_state_dict(s["window"])
            series.score_window.load_state_dict(s["score_window"])
            series.scored, series.flagged = int(s["scored"]), int(s["flagged"])
            self.series[name] = series
