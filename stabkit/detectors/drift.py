"""Drift (early warning): sustained growth of max attention logit, log Z and residual-stream RMS.

Runs when the detectors consume a value (log interval, or every step with a non-warn drift
action). These series are measured on sampled steps, so a window of `window` values
(`DriftOptions`, ``DetectConfig.options["drift"]``) spans `window × MonitorConfig.every` steps. Pure
and checkpointable.

Per series, once the window is full and the newest value is past the rule's level, a robust
Theil–Sen slope (`scipy.stats.theilslopes`, 95 % interval) is fitted; drift is reported when the
interval's lower end is above zero (growth, not noise), the fitted end value is past the level
and the fitted change over the window is at least the rule's minimum:

| series | fitted on | level | change | why |
|---|---|---|---|---|
| ``attn/<attn>/max_logit`` | log value | ``attn_logit_level`` (50) | ×(1 + ``attn_logit_growth``) | Gemma 2 / Rybakov cap at 50; Wortsman: runs above 1e4 diverged |
| ``logits/logz_mean`` | \\|log Z − log V\\| | ``logz_level`` (10 nats) | ``logz_change`` nats | output-logit divergence (Wortsman §3.1.2); log V is log Z at zero logits |
| ``act/<block>/rms`` | log value | ``residual_level`` × its first values | ×(1 + ``residual_growth``) | residual growth (Rybakov: >2× in diverging runs) |

With ``qk_clip`` on an attention module (seen from its series ``qk_clip/<attn>/max_logit``, the exact
*signed* max), the module's logit drift is no longer judged: QK-Clip holds its largest logit at τ
after every step, and the sampled max |logit| there can only grow through logits growing more
negative (keys left unattended) — a drift event would name the fix that is already on.

After an event a series stays quiet for one window, so a drift is reported once per window.
The levels keep early-training growth from init (attention logits ~3 → ~10) silent.

**Severity.** Growth while the model keeps learning is not yet trouble: Muon grows the residual
stream steadily (Llama + Muon: ``act/*/rms`` past 30× its start at step 190 while the loss fell to
1.94), and attention logits grow as heads sharpen. So a drift is a *note* ('info') while the loss
still falls over the drift's window, or the last ``loss_span`` (100) steps when that is longer (the
median of the span's last third below that of its first third; the detector reads ``loss`` for it) and the value is below its danger line; a *warning* when
the loss has stopped falling, or the value is past the danger line:

| series | danger line | why |
|---|---|---|
| attention max logit | ``attn_logit_danger`` (1e3) | Wortsman et al. Fig. 10: forcing the logit to ~1e3 degrades the loss; runs above 1e4 diverged |
| \\|log Z − log V\\| | ``logz_danger`` (20 nats) | twice the drift level: softmax saturates, bf16 loses the logits' resolution |
| residual RMS | ``residual_danger`` (300× its start) | ten times the drift level |
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np

from ..events import Event
from ..metric_names import ACT, ATTN, QK_CLIP, metric, path_of
from ..plugins import DETECTORS
from ..tables import bounds
from .advice import Advice
from .base import Detector, DetectorContext, Observation
from .rolling import grade_by_loss, median_sorted

LOSS_KEPT = 4096
"""Newest losses the drift detector keeps (a window of 20 values sampled every 100 steps spans 2000)."""

WORTSMAN_DIVERGED = 1e4
"""Wortsman et al. 2023: every run whose max attention logit exceeded 1e4 diverged."""


@dataclass(frozen=True)
class DriftOptions:
    """``DetectConfig.options["drift"]``."""

    window: int = field(default=20, metadata=bounds(lo=5, hint="a slope needs points"))
    """Values (sampled steps) in the robust-slope window of each drift series."""
    attn_logit_level: float = field(default=50.0, metadata=bounds(lo=0))
    """Drift on attention logits only above this max |logit| (Gemma 2 and Rybakov et al. cap at 50)."""
    attn_logit_growth: float = field(default=0.25, metadata=bounds(lo=0, lo_open=True))
    """... and when the fitted max logit grew by at least this fraction over the window."""
    logz_level: float = field(default=10.0, metadata=bounds(lo=0))
    """Drift on log Z only when mean log Z is at least this many nats from log(vocab) (its value at zero logits)."""
    logz_change: float = field(default=0.5, metadata=bounds(lo=0, lo_open=True))
    """... and moved at least this many nats away over the window."""
    residual_level: float = field(default=30.0, metadata=bounds(lo=0))
    """Drift on residual RMS only above this multiple of the series' first values (Rybakov et al.: 2× in diverging runs)."""
    residual_growth: float = field(default=0.25, metadata=bounds(lo=0, lo_open=True))
    """... and when the fitted RMS grew by at least this fraction over the window."""
    attn_logit_danger: float = field(default=1e3, metadata=bounds(lo=0, lo_open=True))
    """A drifting max |logit| at or above this is a warning even while the loss falls."""
    logz_danger: float = field(default=20.0, metadata=bounds(lo=0, lo_open=True))
    """A drifting |log Z − log V| at or above this many nats is a warning even while the loss falls."""
    residual_danger: float = field(default=300.0, metadata=bounds(lo=0, lo_open=True))
    """A drifting residual RMS at or above this multiple of its first values is a warning even while
    the loss falls."""
    loss_span: int = field(default=100, metadata=bounds(lo=1))
    """The fewest steps over which "the loss still falls" is judged (the drift's window when longer):
    sampled every step, a 20-step window's loss is mostly noise, and a healthy run's loss then looks
    stalled one window in three."""


@dataclass
class DriftRule:
    """How one family of series is judged."""

    family: Literal["attn_logit", "logz", "residual"]
    space: Literal["log", "offset"]
    """'log': fit log(value) (multiplicative growth); 'offset': fit |value − reference| (nats)."""
    level: float
    change: float
    reference: float | None = None
    """'offset' space: the value drift is measured from. 'log' space with relative level: None."""
    relative_level: bool = False
    """'log' space: the level is a multiple of the series' first values."""


@dataclass
class DriftSeries:
    """Window of (step, value) of one series plus its reference and cooldown."""

    window: deque[tuple[int, float]]
    first: list[float] = field(default_factory=list)
    quiet_until: int = 0
    """Count of values before which no event is reported (cooldown after an event)."""
    seen: int = 0


@DETECTORS.register
class DriftDetector(Detector):
    """Watches the drift series of one model (named from its attention modules and blocks)."""

    kind = "drift"
    options_class = DriftOptions
    advice: ClassVar[dict[str, Advice]] = {
        "attn_logit_growth": Advice(
            "max attention logit keeps growing",
            ("qk_clip", "qk_norm", "attn_softcap"),
            "clip the heads past a threshold on their q/k weights after each step (QK-Clip, Kimi K2: tau 100), normalise q and k (ViT-22B; Wortsman et al. 2023: runs above 1e4 diverged) or soft-cap attention logits at 50 (Gemma 2)",
        ),
        "logz_drift": Advice(
            "log Z drifts away from log V",
            ("z_loss", "logit_softcap"),
            "add z-loss 1e-4·log²Z (PaLM; OLMo 2 / Chameleon use 1e-5) or soft-cap output logits at 30 (Gemma 2); weight decay also helps (Wortsman et al. 2023)",
        ),
        "residual_growth_post": Advice(
            "residual RMS grows in a post-norm model",
            ("norm_placement",),
            "move the norms to pre (Xiong et al. 2020) or sandwich placement; post-norm also needs a long warmup",
        ),
        "residual_growth_pre": Advice(
            "residual RMS grows in a pre-norm model",
            ("norm_placement", "rmsnorm"),
            "sandwich / reordered norm h = x + norm(f(x)) with RMSNorm (OLMo 2, Chameleon 34B) bounds what each block adds",
        ),
    }

    def __init__(self, ctx: DetectorContext) -> None:
        super().__init__(ctx)
        self.options = c = ctx.options(self.kind, DriftOptions)
        log_v = ctx.log_vocab
        self.rules: dict[str, DriftRule] = {}
        for path in ctx.attention_paths:
            for name in (metric(ATTN, path, "max_logit"), metric(QK_CLIP, path, "max_logit")):
                self.rules[name] = DriftRule("attn_logit", "log", c.attn_logit_level, c.attn_logit_growth)
        self.clipped: set[str] = set()
        """Attention modules with qk_clip on: their logit drift is not judged (see the module docstring)."""
        self.rules["logits/logz_mean"] = DriftRule("logz", "offset", c.logz_level, c.logz_change, log_v)
        for path in ctx.block_paths:
            self.rules[metric(ACT, path, "rms")] = DriftRule(
                "residual", "log", c.residual_level, c.residual_growth, relative_level=True
            )
        self.series: dict[str, DriftSeries] = {}
        self.losses: deque[tuple[int, float]] = deque(maxlen=LOSS_KEPT)
        """(step, loss) of the newest steps: whether the loss still falls over a drift's window."""

    def wants(self, name: str) -> bool:
        """True when `name` is a drift series, or the loss."""
        return name in self.rules or name == "loss"

    def observe(self, step: int, values: Mapping[str, float]) -> Observation:
        """A drift event per series whose window shows sustained growth."""
        events = [e for name, x in values.items() if (e := self.update(step, name, x)) is not None]
        return Observation(events)

    def signature(self, event: Event) -> str:
        """attn_logit_growth, logz_drift, or residual growth by the block's norm placement."""
        family = event.details.get("family")
        if family == "residual":
            block = self.ctx.block_of(path_of(event.where))
            return "residual_growth_post" if block and block.placement == "post" else "residual_growth_pre"
        return "logz_drift" if family == "logz" else "attn_logit_growth"

    def update(self, step: int, name: str, x: float) -> Event | None:
        """Consume value `x` of series `name` at `step`; a drift event or None."""
        if name == "loss":
            if math.isfinite(x):
                self.losses.append((step, x))
            return None
        rule = self.rules.get(name)
        if rule is None or not math.isfinite(x):
            return None
        if name.startswith(QK_CLIP + "/"):
            self.clipped.add(path_of(name))
            return None
        if rule.family == "attn_logit" and path_of(name) in self.clipped:
            return None
        s = self.series.get(name)
        if s is None:
            s = self.series[name] = DriftSeries(deque(maxlen=self.options.window))
        s.window.append((step, x))
        s.seen += 1
        if len(s.first) < 5:
            s.first.append(x)
        if rule.space == "offset" and rule.reference is None:
            rule.reference = s.first[0]
        if len(s.window) < self.options.window or s.seen < s.quiet_until:
            return None
        event = self._judge(name, rule, s)
        if event is not None:
            s.quiet_until = s.seen + self.options.window
        return event

    def _level(self, rule: DriftRule, s: DriftSeries) -> float:
        if rule.relative_level:
            return rule.level * median_sorted(sorted(s.first))  # numpy's median, without its overhead
        return rule.level

    def _judge(self, name: str, rule: DriftRule, s: DriftSeries) -> Event | None:
        level = self._level(rule, s)
        last = s.window[-1][1]
        below = last < level if rule.space == "log" else abs(last - (rule.reference or 0.0)) < level
        if below:  # the usual answer, before any array is made
            return None
        steps = np.array([t for t, _ in s.window], dtype=np.float64)
        raw = np.array([v for _, v in s.window], dtype=np.float64)
        if rule.space == "log":
            if (raw <= 0).any():  # no log of it (the level check above came before the O(n²) fit)
                return None
            y = np.log(raw)
        else:
            y = np.abs(raw - (rule.reference or 0.0))
        from scipy.stats import theilslopes  # scipy.stats takes ~1.5 s to import: load on the first fit

        slope, intercept, low, _high = theilslopes(y, steps)
        span = steps[-1] - steps[0]
        fit_start, fit_end = intercept + slope * steps[0], intercept + slope * steps[-1]
        if rule.space == "log":
            change, end = math.exp(slope * span) - 1.0, math.exp(fit_end)
        else:
            change, end = fit_end - fit_start, fit_end
        if not (low > 0 and end >= level and change >= rule.change):
            return None
        return self._event(name, rule, s, raw[-1], level, slope, change, span, end)

    def _event(
        self,
        name: str,
        rule: DriftRule,
        s: DriftSeries,
        last: float,
        level: float,
        slope: float,
        change: float,
        span: float,
        end: float,
    ) -> Event:
        step = s.window[-1][0]
        details: dict[str, Any] = {
            "series": name,
            "family": rule.family,
            "window_steps": span,
            "slope": slope,
            "since": s.window[0][0],
        }
        if rule.space == "log":
            what = f"grew {1 + change:.2f}× over the last {span:.0f} steps (robust slope > 0) to {last:.4g}"
            details["growth"] = 1 + change
            if rule.family == "attn_logit" and slope > 0 and last < WORTSMAN_DIVERGED:
                eta = math.log(WORTSMAN_DIVERGED / last) / slope
                details["steps_to_1e4"] = eta
                what += f"; at this rate it reaches 1e4 (where Wortsman et al.'s runs diverged) in ~{eta:.0f} steps"
        else:
            what = (
                f"moved {change:.2f} nats further from log V over the last {span:.0f} steps "
                f"(|log Z − log V| = {end:.2f})"
            )
            details["offset"] = end
        severity, why = self._severity(rule, s, last, end)
        details["loss_falling"] = why.startswith("while")
        return Event(
            step, "drift", name, last, level, f"{name} {what} {why}", details=details, severity=severity
        )

    def _severity(self, rule: DriftRule, s: DriftSeries, last: float, end: float) -> tuple[str, str]:
        """('info' | 'warning', the reason in words) of a drift of `rule` whose window is `s`."""
        o = self.options
        if rule.family == "attn_logit":
            danger, past = o.attn_logit_danger, last >= o.attn_logit_danger
        elif rule.family == "logz":
            danger, past = o.logz_danger, end >= o.logz_danger
        else:
            danger = o.residual_danger * median_sorted(sorted(s.first))
            past = last >= danger
        if past:
            return "warning", f"— past its danger line {danger:.4g}"
        end_step = s.window[-1][0]
        start = min(s.window[0][0], end_step - self.options.loss_span)
        return grade_by_loss(self.losses, start, end_step, f"past {danger:.4g}")

    def rewind(self, step: int) -> None:
        """Forget every window value from `step` on, and the cooldowns (the first values and the log
        Z reference stay: they describe the run's start, which the rollback kept)."""
        for s in self.series.values():
            kept = [(t, v) for t, v in s.window if t < step]
            s.window.clear()
            s.window.extend(kept)
            s.quiet_until = 0

    def state_dict(self) -> dict[str, Any]:
        """Plain state: windows, first values, cooldowns, and the log Z reference."""
        return {
            name: {
                "window": [list(p) for p in s.window],
                "first": s.first,
                "quiet_until": s.quiet_until,
                "seen": s.seen,
            }
            for name, s in self.series.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()` output."""
        self.series = {}
        for name, s in state.items():
            window: deque[tuple[int, float]] = deque(maxlen=self.options.window)
            window.extend((int(t), float(v)) for t, v in s["window"])
            self.series[name] = DriftSeries(
                window, [float(v) for v in s["first"]], int(s["quiet_until"]), int(s["seen"])
            )
            rule = self.rules.get(name)
            if (
                rule is not None
                and rule.space == "offset"
                and rule.reference is None
                and self.series[name].first
            ):
                rule.reference = self.series[name].first[0]
