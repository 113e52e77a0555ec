"""Metric names, built and taken apart in one place.

A per-module statistic is ``family/module.path/stat`` (``act/blocks.3.mlp/rms``,
``attn/blocks.0.attn/max_logit``), a model-wide one ``family/stat`` (``logits/logz_max``,
``grad/global_norm``), and a few are bare (``loss``). The probes build names with `metric`; the
detectors, sinks and plots read them with `parse` / `is_stat` instead of slicing strings. A leaf:
imports nothing of stabkit, no torch.

When it runs: names are built when a probe lays out its statistics (at attach, or at a hook's first
call) and read when a detector sets up its rules (attach) or judges a row (each step it is shown).
"""

from __future__ import annotations

from dataclasses import dataclass

ACT = "act"
"""Activations of a module's output (`stabkit.probes.activations`, `outliers`)."""
ATTN = "attn"
"""Attention logits, entropy and sinks of an attention module (`stabkit.probes.attention`)."""
GRAD = "grad"
"""Gradient norms (per unit, and ``grad/global_norm``)."""
PARAM = "param"
"""Parameter norms per unit."""
UPDATE = "update"
"""Update norms and update/parameter ratios per unit."""
LOGITS = "logits"
"""The model's output logits (``logits/logz_max``...)."""
MOE = "moe"
"""A mixture-of-experts layer's routing: loads, their ratios, router entropy and log Z (`stabkit.moe`)."""
QK_CLIP = "qk_clip"
"""QK-Clip's own per-module readings (`stabkit.interventions.qkclip`)."""


@dataclass(frozen=True)
class MetricName:
    """A name taken apart: its family, module path ('' for a model-wide statistic) and statistic."""

    family: str
    path: str
    stat: str

    def __str__(self) -> str:
        return metric(self.family, self.path, self.stat)


def metric(family: str, path: str, stat: str) -> str:
    """``family/path/stat``, or ``family/stat`` when `path` is empty (a model-wide statistic)."""
    return f"{family}/{path}/{stat}" if path else f"{family}/{stat}"


def parse(name: str) -> MetricName | None:
    """`name` taken apart (None for a bare name such as ``loss``). The path is everything between the
    family and the last ``/``, so module paths keep their dots."""
    family, sep, rest = name.partition("/")
    if not sep:
        return None
    path, _, stat = rest.rpartition("/")
    return MetricName(family, path, stat)


def is_stat(name: str, family: str, stat: str) -> bool:
    """`name` is statistic `stat` of family `family` (of any module)."""
    return name.startswith(family + "/") and name.endswith("/" + stat)


def path_of(name: str) -> str:
    """The module path of a per-module metric ('' for a model-wide or bare name)."""
    parsed = parse(name)
    return parsed.path if parsed is not None else ""


def stat_of(name: str) -> str:
    """The statistic of `name` (the name itself when bare)."""
    parsed = parse(name)
    return parsed.stat if parsed is not None else name
