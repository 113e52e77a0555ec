"""The parts of a recipe, as dataclasses, and their parsing from TOML tables with validation.

A recipe is parsed once (`stabkit.harness.recipes.loader.load_recipe`), after the size's ``[sizes.<name>]``
table has been merged over the top level; every unknown key and out-of-range value raises a
`RecipeError` naming the key (``train.lr``) and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..training import TrainConfig
from .checks import Check, parse_checks
from .errors import RecipeError
from .fields import boolean, choice, integer, integers, number, numbers, string, table

PRECISIONS = ("fp32", "bf16", "fp16")
FAULT_KINDS = ("nan", "inf", "bad_batch")


@dataclass
class TrainSpec:
    """Optimizer, schedule and length (the fields of `stabkit.harness.training.TrainConfig`, plus precision)."""

    steps: int = 300
    """Optimizer steps."""
    batch_size: int | None = None
    """Sequences per step (None: the preset's `PRESET_BATCH`)."""
    lr: float = 1e-2
    """Peak learning rate."""
    warmup: int = 15
    """Linear warmup steps (0 = none)."""
    min_lr_fraction: float = 0.01
    """Cosine decay ends at this fraction of the peak."""
    weight_decay: float = 1e-4
    """Weight decay on matrices (not embeddings, norms, biases)."""
    independent_decay: bool = True
    """Decay independent of the LR (Wortsman et al. 2023); false = torch AdamW coupling."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas."""
    eps: float = 1e-8
    """Adam epsilon."""
    clip: float = 1.0
    """Global grad-norm clip (0 = off)."""
    seed: int = 0
    """Seed of the model init and the data order (shared by every variant)."""
    eval_batches: int = 32
    """Held-out batches evaluated at the end."""
    grad_accum: int = 1
    """Micro-batches per optimizer step."""
    precision: str = "fp32"
    """fp32, or bf16 / fp16 autocast for the forward pass."""

    def to_train_config(self, batch_size: int) -> TrainConfig:
        """The loop's config (batch size resolved by the caller)."""
        return TrainConfig(
            steps=self.steps,
            batch_size=self.batch_size or batch_size,
            lr=self.lr,
            warmup=self.warmup,
            min_lr_fraction=self.min_lr_fraction,
            weight_decay=self.weight_decay,
            independent_decay=self.independent_decay,
            betas=self.betas,
            eps=self.eps,
            clip=self.clip or None,
            seed=self.seed,
            eval_batches=self.eval_batches,
            grad_accum=self.grad_accum,
        )


TRAIN_KEYS = tuple(TrainSpec.__dataclass_fields__)


def parse_train(raw: Any, where: str = "train", base: TrainSpec | None = None) -> TrainSpec:
    """A [train] table over `base` (defaults when None)."""
    t = table(raw, where, TRAIN_KEYS)
    spec = TrainSpec(**vars(base)) if base is not None else TrainSpec()
    readers: dict[str, Any] = {
        "steps": lambda v, w: integer(v, w, lo=1),
        "batch_size": _batch_size,
        "lr": lambda v, w: number(v, w, lo_open=True),
        "warmup": lambda v, w: integer(v, w, lo=0),
        "min_lr_fraction": lambda v, w: number(v, w, hi=1.0),
        "weight_decay": lambda v, w: number(v, w),
        "independent_decay": boolean,
        "betas": _betas,
        "eps": lambda v, w: number(v, w, lo_open=True),
        "clip": lambda v, w: number(v, w),
        "seed": lambda v, w: integer(v, w, lo=0),
        "eval_batches": lambda v, w: integer(v, w, lo=1),
        "grad_accum": lambda v, w: integer(v, w, lo=1),
        "precision": lambda v, w: choice(v, w, PRECISIONS),
    }
    for key, value in t.items():
        setattr(spec, key, readers[key](value, f"{where}.{key}"))
    return spec


MAX_BATCH_SIZE = 4096
"""The largest `train.batch_size` (sequences per micro-batch) a recipe may ask for."""


def _batch_size(raw: Any, where: str) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool) and raw > MAX_BATCH_SIZE:
        raise RecipeError(
            where,
            f"must be an integer in [1, {MAX_BATCH_SIZE}] (sequences per micro-batch), got {raw}; "
            "for a larger batch per optimizer step set train.grad_accum (micro-batches per step)",
        )
    return integer(raw, where, lo=1, hi=MAX_BATCH_SIZE)


def _betas(raw: Any, where: str) -> tuple[float, float]:
    b1, b2 = (
        number(b, f"{where}[{i}]", hi=1.0, hi_open=True)
        for i, b in enumerate(numbers(raw, where, 2, lo_open=False))
    )
    return b1, b2


@dataclass
class MonitorSpec:
    """How the monitor samples (see `stabkit.MonitorConfig`)."""

    every: int = 10
    """Per-layer statistics every N steps."""
    attn_every: int = 5
    """Attention-logit statistics every N steps."""
    log_every: int = 50
    """Host copy and sink writes every N steps."""
    attn_sample_rows: int = 4
    """Batch rows the attention probe measures (0 = all)."""
    attn_sample_queries: int = 64
    """Query positions per row the attention probe measures (0 = all)."""


def parse_monitor(raw: Any) -> MonitorSpec:
    """The [monitor] table."""
    t = table(raw, "monitor", tuple(MonitorSpec.__dataclass_fields__))
    lows = {"attn_sample_rows": 0, "attn_sample_queries": 0}
    return MonitorSpec(**{k: integer(v, f"monitor.{k}", lo=lows.get(k, 1)) for k, v in t.items()})


@dataclass
class FaultSpec:
    """A fault injected on purpose at a known step (the trigger of nan-injection and loss-spike)."""

    kind: str
    """nan / inf: one value of `module`'s output becomes NaN / Inf; bad_batch: random bytes replace the batch."""
    step: int
    """Training step of the fault (scaled with the run when `--steps` shortens it)."""
    module: str = "blocks.0.mlp.fc"
    """Module whose output is corrupted (nan / inf)."""
    length: int = 1
    """Consecutive steps the fault lasts."""


def parse_fault(raw: Any) -> FaultSpec | None:
    """The optional [fault] table."""
    if raw is None:
        return None
    t = table(raw, "fault", tuple(FaultSpec.__dataclass_fields__))
    if "kind" not in t or "step" not in t:
        raise RecipeError("fault", "needs kind (nan, inf, bad_batch) and step")
    return FaultSpec(
        kind=choice(t["kind"], "fault.kind", FAULT_KINDS),
        step=integer(t["step"], "fault.step"),
        module=string(t.get("module", "blocks.0.mlp.fc"), "fault.module"),
        length=integer(t.get("length", 1), "fault.length", lo=1),
    )


@dataclass
class DepthSpec:
    """An init-time depth sweep (Xiong et al. 2020, Theorem 1): last-layer ‖∇W₂‖ per depth."""

    layers: list[int] = field(default_factory=lambda: [2, 4, 8, 16])
    """Depths to build."""
    ratio: tuple[int, int] = (4, 16)
    """`depth_grad_ratio` = grad norm at ratio[1] layers / at ratio[0] layers."""
    repeats: int = 4
    """Seeds averaged per depth."""


def parse_depth(raw: Any) -> DepthSpec | None:
    """The optional [depth] table."""
    if raw is None:
        return None
    t = table(raw, "depth", tuple(DepthSpec.__dataclass_fields__))
    spec = DepthSpec()
    if "layers" in t:
        spec.layers = integers(t["layers"], "depth.layers")
    if "ratio" in t:
        pair = integers(t["ratio"], "depth.ratio")
        if len(pair) != 2 or any(p not in spec.layers for p in pair):
            raise RecipeError(
                "depth.ratio", f"must be two depths from depth.layers {spec.layers}, got {pair}"
            )
        spec.ratio = (pair[0], pair[1])
    elif any(p not in spec.layers for p in spec.ratio):
        spec.ratio = (spec.layers[0], spec.layers[-1])
    if "repeats" in t:
        spec.repeats = integer(t["repeats"], "depth.repeats", lo=1)
    return spec


@dataclass
class SweepSpec:
    """The LR grid of `stabkit sweep` and its criteria."""

    lrs: list[float] = field(default_factory=lambda: [3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1])
    """Peak learning rates (Wortsman et al. 2023's grid by default)."""
    high: tuple[float, float] = (1e-2, 3e-1)
    """The high end of the grid, for `lr_sensitivity_high`."""
    reproduced: list[Check] = field(default_factory=list)
    """Checks on the baseline's sweep quantities."""
    fixed: list[Check] = field(default_factory=list)
    """Checks on each intervention's sweep quantities."""


def parse_sweep(raw: Any) -> SweepSpec:
    """The optional [sweep] table (defaults when absent)."""
    t = table(raw, "sweep", tuple(SweepSpec.__dataclass_fields__))
    spec = SweepSpec()
    if "lrs" in t:
        spec.lrs = sorted(numbers(t["lrs"], "sweep.lrs"))
    if "high" in t:
        lo, hi = numbers(t["high"], "sweep.high", 2)
        if lo >= hi:
            raise RecipeError("sweep.high", f"must be [low, high] with low < high, got {[lo, hi]}")
        spec.high = (lo, hi)
    spec.reproduced = parse_checks(t.get("reproduced", []), "sweep.reproduced", sweep=True)
    spec.fixed = parse_checks(t.get("fixed", []), "sweep.fixed", sweep=True)
    return spec
