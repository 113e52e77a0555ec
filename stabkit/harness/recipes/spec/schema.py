"""The tables of a recipe, filled into the real configs with one loader (`stabkit.tables.fill`).

``[train]`` fills `stabkit.harness.training.TrainConfig`, ``[model]`` a `GPTConfig` over the size's
preset, ``[monitor]`` a `stabkit.MonitorConfig`, ``[detect]`` a `stabkit.DetectConfig`; ``[fault]``,
``[depth]`` and ``[sweep]`` fill the harness-only dataclasses below. A recipe is parsed once
(`stabkit.harness.recipes.loader.load_recipe`), after the size's ``[sizes.<name>]`` table has been
merged over the top level; every unknown key and out-of-range value raises a `RecipeError` naming
the key (``train.lr``) and what is allowed.

Where a recipe's default differs from the library's, `RECIPE_DEFAULTS` says so (and why); a
recipe's tables are filled over those.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ....config import MonitorConfig
from ....detect_config import DetectConfig
from ....tables import TableError, bounds, fill
from ...data.synthetic import SyntheticSpec
from ...models import GPTConfig, preset_config
from ...models.presets import PRESET_BATCH
from ...training import TrainConfig
from .checks import Check, parse_checks
from .errors import RecipeError

FAULT_KINDS = ("nan", "inf", "bad_batch")

RECIPE_DEFAULTS: dict[str, dict[str, Any]] = {
    "train": {
        "eval_batches": 32,  # the verdicts compare held-out losses: 8 batches are too noisy for that
        # batch_size: the size preset's (`PRESET_BATCH`), see `train_defaults`
    },
    "monitor": {
        "attn_every": 5,  # the attention-logit recipes watch the logits twice as often as the rest
    },
}
"""Recipe defaults that differ from the library's (the rest are the dataclasses' own defaults)."""

MONITOR_EXCLUDED = ("detect",)
"""[monitor] keys a recipe may not set: detectors come from [detect] and the variants' tables."""


def train_defaults(size: str) -> TrainConfig:
    """The TrainConfig a recipe's [train] table fills: library defaults, `RECIPE_DEFAULTS`, and the
    size preset's batch."""
    return TrainConfig(**{**RECIPE_DEFAULTS["train"], "batch_size": PRESET_BATCH[size]})


def parse_train(raw: Any, where: str, base: TrainConfig) -> TrainConfig:
    """A [train] table over `base`."""
    return _fill(TrainConfig, raw, where, base)


def parse_monitor(raw: Any) -> MonitorConfig:
    """The [monitor] table over the recipe defaults (any MonitorConfig field but detect)."""
    base = MonitorConfig(**RECIPE_DEFAULTS["monitor"])
    return _fill(MonitorConfig, raw, "monitor", base, exclude=MONITOR_EXCLUDED)


def parse_detect(raw: Any, where: str, base: DetectConfig | None = None) -> DetectConfig:
    """A [detect] table (the recipe's, or a variant's over the recipe's)."""
    return _fill(DetectConfig, raw, where, base)


def parse_model(raw: Any, size: str) -> GPTConfig:
    """The [model] table: GPTConfig fields over the size's preset."""
    return _fill(GPTConfig, raw, "model", preset_config(size))


def parse_model_over(raw: Any, where: str, base: GPTConfig) -> GPTConfig:
    """A variant's model table: GPTConfig fields over the recipe's resolved [model]."""
    return _fill(GPTConfig, raw, where, base)


def _fill(cls: type[Any], raw: Any, where: str, base: Any = None, exclude: tuple[str, ...] = ()) -> Any:
    try:
        return fill(cls, raw, where, base, exclude=exclude)
    except TableError as exc:
        raise RecipeError.of(exc) from None


def parse_synthetic(raw: Any) -> SyntheticSpec | None:
    """The ``[data] synthetic`` table (a `SyntheticSpec`: vocab, zipf, tokens, clusters, local, seed),
    or None when absent."""
    return None if raw is None else _fill(SyntheticSpec, raw, "data.synthetic")


@dataclass
class FaultSpec:
    """A fault injected on purpose at a known step (the trigger of nan-injection and loss-spike)."""

    kind: Literal["nan", "inf", "bad_batch"]
    """nan / inf: one value of `module`'s output becomes NaN / Inf; bad_batch: random bytes replace the batch."""
    step: int = field(metadata=bounds(lo=0))
    """Training step of the fault (scaled with the run when `--steps` shortens it)."""
    module: str = "blocks.0.mlp.fc"
    """Module whose output is corrupted (nan / inf)."""
    length: int = field(default=1, metadata=bounds(lo=1))
    """Consecutive steps the fault lasts."""


def parse_fault(raw: Any) -> FaultSpec | None:
    """The optional [fault] table."""
    if raw is None:
        return None
    if isinstance(raw, dict) and ("kind" not in raw or "step" not in raw):
        raise RecipeError("fault", f"needs kind ({', '.join(FAULT_KINDS)}) and step")
    spec: FaultSpec = _fill(FaultSpec, raw, "fault")
    return spec


@dataclass
class DepthSpec:
    """An init-time depth sweep (Xiong et al. 2020, Theorem 1): last-layer ‖∇W₂‖ per depth."""

    layers: list[int] = field(default_factory=lambda: [2, 4, 8, 16], metadata=bounds(lo=1))
    """Depths to build."""
    ratio: tuple[int, int] = field(default=(4, 16), metadata=bounds(lo=1))
    """`depth_grad_ratio` = grad norm at ratio[1] layers / at ratio[0] layers."""
    repeats: int = field(default=4, metadata=bounds(lo=1))
    """Seeds averaged per depth."""


def parse_depth(raw: Any) -> DepthSpec | None:
    """The optional [depth] table (without a ratio: the first and last depth when the default
    ratio's depths are not all built)."""
    if raw is None:
        return None
    spec: DepthSpec = _fill(DepthSpec, raw, "depth")
    if not spec.layers:
        raise RecipeError("depth.layers", "must be a non-empty array of integers, got []")
    if "ratio" in raw:
        if any(p not in spec.layers for p in spec.ratio):
            raise RecipeError(
                "depth.ratio", f"must be two depths from depth.layers {spec.layers}, got {list(spec.ratio)}"
            )
    elif any(p not in spec.layers for p in spec.ratio):
        spec.ratio = (spec.layers[0], spec.layers[-1])
    return spec


@dataclass
class SweepSpec:
    """The LR grid of `stabkit sweep` and its criteria."""

    lrs: list[float] = field(
        default_factory=lambda: [3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1],
        metadata=bounds(lo=0.0, lo_open=True),
    )
    """Peak learning rates (Wortsman et al. 2023's grid by default)."""
    high: tuple[float, float] = field(default=(1e-2, 3e-1), metadata=bounds(lo=0.0, lo_open=True))
    """The high end of the grid, for `lr_sensitivity_high`."""
    reproduced: list[Check] = field(default_factory=list)
    """Checks on the baseline's sweep quantities."""
    fixed: list[Check] = field(default_factory=list)
    """Checks on each intervention's sweep quantities."""


def parse_sweep(raw: Any) -> SweepSpec:
    """The optional [sweep] table (defaults when absent)."""
    checks = ("reproduced", "fixed")
    plain = {k: v for k, v in raw.items() if k not in checks} if isinstance(raw, dict) else raw
    spec: SweepSpec = _fill(SweepSpec, plain, "sweep")
    if not spec.lrs:
        raise RecipeError("sweep.lrs", "must be a non-empty array of numbers, got []")
    spec.lrs = sorted(spec.lrs)
    lo, hi = spec.high
    if lo >= hi:
        raise RecipeError("sweep.high", f"must be [low, high] with low < high, got {[lo, hi]}")
    raw = raw or {}
    spec.reproduced = parse_checks(raw.get("reproduced", []), "sweep.reproduced", sweep=True)
    spec.fixed = parse_checks(raw.get("fixed", []), "sweep.fixed", sweep=True)
    return spec
