"""The 'outliers' kind: the onset of massive activations, attention-sink growth and outlier-feature
(kurtosis) growth — slow structural changes that precede low-precision failures and divergence.

Series (on sampled steps; the outlier probe and the attention probe write them):

| signature | series | fires when |
|---|---|---|
| ``massive_activation_onset`` | ``act/<block>/massive_ratio`` | ≥ ``massive_level`` (100) and ≥ ``massive_growth`` (5×) its start |
| ``attention_sink_growth`` | ``attn/<attn>/first_key_mass`` | ≥ ``sink_level`` (0.6) and ≥ its start + ``sink_rise`` (0.3) |
| ``kurtosis_growth`` | ``act/<block>/kurtosis`` | ≥ ``kurtosis_level`` (100) and ≥ ``kurtosis_growth`` (5×) max(its start, 1) |

Sun et al. 2024: massive activations are ~1000× the median magnitude of their hidden state (at init
the ratio of a Gaussian state of width 256 is ~6). Gu et al. (ICLR 2025): a sink head puts > 0.3 of
its attention on the first key; Qwen's gated attention cut first-token attention from 46.7 % to
4.8 %. He et al. (NeurIPS 2024) / OSP: excess kurtosis of the channel scales 1818 with Adam against
0.04 — outlier features, FOG's predictor of fp8 divergence. The *start* is the median of a series'
first `baseline` values; the condition must hold for `persist` consecutive values; one event per
onset (the series re-arms once it falls back below its level). Runs when the detectors consume
values (see `stabkit.detectors.base`). Options: `OutlierOptions` (``DetectConfig.options["outliers"]``).
Pure Python; checkpointable.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..events import Event
from ..metric_names import path_of, stat_of
from ..plugins import DETECTORS
from ..tables import bounds
from .advice import Advice
from .base import Detector, DetectorContext, Observation


@dataclass(frozen=True)
class OutlierOptions:
    """``DetectConfig.options["outliers"]``."""

    massive_level: float = field(default=100.0, metadata=bounds(lo=1))
    """Massive activation: a token's largest |x| at least this many times its median |x| (Sun et al.: ~1000)."""
    massive_growth: float = field(default=5.0, metadata=bounds(lo=1))
    """... and at least this multiple of the series' start."""
    sink_level: float = field(default=0.6, metadata=bounds(lo=0, hi=1))
    """Sink growth: the largest per-head first-key mass at least this (Gu et al.'s sink heads: > 0.3)."""
    sink_rise: float = field(default=0.3, metadata=bounds(lo=0, hi=1, lo_open=True))
    """... and at least this much above the series' start."""
    kurtosis_level: float = field(default=100.0, metadata=bounds(lo=0))
    """Outlier features: excess kurtosis of the channel RMS at least this (OSP: 1818 with Adam, 0.04
    without outliers). D channels reach at most D − 3 (one outlier channel): a healthy d-64 model on
    the synthetic Zipf language reached 43 at LR 1e-2, so the level sits above what small models can."""
    kurtosis_growth: float = field(default=5.0, metadata=bounds(lo=1))
    """... and at least this multiple of max(start, 1)."""
    baseline: int = field(default=5, metadata=bounds(lo=1))
    """First values of a series whose median is its start."""
    persist: int = field(default=3, metadata=bounds(lo=1))
    """Consecutive values that must meet the condition."""


RULES = {
    "massive_ratio": ("massive_activation_onset", "massive"),
    "first_key_mass": ("attention_sink_growth", "sink"),
    "kurtosis": ("kurtosis_growth", "kurtosis"),
}
"""Series statistic -> (signature, options prefix)."""


@dataclass
class _Series:
    first: list[float] = field(default_factory=list)
    run: int = 0
    """Consecutive values meeting the condition."""
    armed: bool = True
    since: int | None = None
    """Step of the first value of the current run."""
    start: float | None = None
    """The median of `first`, once it holds the baseline (it does not change after)."""


@DETECTORS.register
class OutlierDetector(Detector):
    """Massive-activation onset, attention-sink growth and kurtosis growth per block / attention module."""

    kind = "outliers"
    options_class = OutlierOptions
    watches = ("act/*/massive_ratio", "attn/*/first_key_mass", "act/*/kurtosis")
    advice: ClassVar[dict[str, Advice]] = {
        "massive_activation_onset": Advice(
            "massive activations appear in the residual stream",
            ("attn_softcap", "qk_norm"),
            "Sun et al. 2024: a few fixed channels ~1000× the median act as attention-sink biases; they break "
            "int8/fp8 quantisation and come with sink heads — gated attention or learned sink logits (Qwen, "
            "GPT-OSS) remove the need for them; keep those channels in higher precision, lower the LR",
        ),
        "attention_sink_growth": Advice(
            "attention heads turn into sinks (mass on the first key grows)",
            ("attn_softcap", "qk_norm"),
            "Gu et al. (ICLR 2025): sink heads (> 0.3 on the first key) grow with training; Qwen's gated "
            "attention cut first-token attention from 46.7 % to 4.8 %; learned sink logits (GPT-OSS) give "
            "heads a no-op target; a fast rise with growing logits: bound the logits (qk_norm, soft cap)",
        ),
        "kurtosis_growth": Advice(
            "outlier features: the kurtosis of channel scales grows",
            ("rmsnorm", "norm_placement"),
            "He et al. (NeurIPS 2024) / OSP: outlier features grow with Adam and non-smooth norms (kurtosis "
            "1818 vs 0.04); FOG: a predictor of fp8 divergence — smaller LR or larger Adam ε, sandwich "
            "/ output norms, keep the affected matmuls in bf16",
        ),
    }

    def __init__(self, ctx: DetectorContext) -> None:
        super().__init__(ctx)
        self.options = ctx.options(self.kind, OutlierOptions)
        self.series: dict[str, _Series] = {}

    def signature(self, event: Event) -> str:
        """The rule's signature (by the series' statistic)."""
        return RULES[stat_of(event.where)][0]

    def _condition(self, stat: str, x: float, start: float) -> tuple[bool, float]:
        """(condition met, the level that applies)."""
        o = self.options
        if stat == "massive_ratio":
            level = max(o.massive_level, o.massive_growth * start)
        elif stat == "first_key_mass":
            level = max(o.sink_level, start + o.sink_rise)
        else:
            level = max(o.kurtosis_level, o.kurtosis_growth * max(start, 1.0))
        return x >= level, level

    def observe(self, step: int, values: Mapping[str, float]) -> Observation:
        """An event per series whose onset condition has just held for `persist` values."""
        o = self.options
        events = []
        for name, x in values.items():
            if x != x or x in (float("inf"), float("-inf")):
                continue  # non-finite: the non-finite detector's business
            stat = stat_of(name)
            if stat not in RULES:
                continue
            s = self.series.setdefault(name, _Series())
            if len(s.first) < o.baseline:
                s.first.append(x)
                continue
            start = s.start
            if start is None:
                start = s.start = statistics.median(s.first)
            met, level = self._condition(stat, x, start)
            if not met:
                s.run, s.since = 0, None
                s.armed = True
                continue
            s.run += 1
            s.since = step if s.since is None else s.since
            if s.armed and s.run >= o.persist:
                s.armed = False
                events.append(self._event(step, name, stat, x, level, start, s.since))
        return Observation(events)

    def _event(
        self, step: int, name: str, stat: str, x: float, level: float, start: float, since: int
    ) -> Event:
        where = path_of(name)
        what = {
            "massive_ratio": f"massive activations in {where}: a token's largest |x| is {x:.4g}× its median",
            "first_key_mass": f"attention sink growing in {where}: a head puts {x:.0%} of its attention on the first key",
            "kurtosis": f"outlier features in {where}: the channel-RMS excess kurtosis is {x:.4g}",
        }[stat]
        return Event(
            step,
            self.kind,
            name,
            x,
            level,
            f"{what} (start {start:.3g}, past {level:.3g} for {self.options.persist} sampled steps)",
            details={"series": name, "start": start, "since": since, "module": where},
        )

    def state_dict(self) -> dict[str, Any]:
        """Per series: its first values, the current run and whether it is armed."""
        return {
            k: {"first": s.first, "run": s.run, "armed": s.armed, "since": s.since}
            for k, s in self.series.items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output."""
        self.series = {
            k: _Series([float(v) for v in s["first"]], int(s["run"]), bool(s["armed"]), s.get("since"))
            for k, s in state.items()
        }
