"""The healthy-run corpus: training setups whose loss falls smoothly, as real runs vary them.

Plain data, read when a corpus run starts (`stabkit.harness.alarms.runner` trains one). Every entry
is a run that should raise no warning: any event of severity ``warning`` or above on it is a false
alarm. Learning rates are chosen conservatively and each entry's loss was checked to fall (the CI
subset test and `stabkit alarms` report first and last loss).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field, replace

from .families import FAMILIES
from .inits import INITS
from .optim import OPTIMIZERS, SCHEDULES

PLACEMENTS = ("pre", "post", "sandwich")
DATA = ("text", "zipf")
MONITORS = ("default", "full")


@dataclass(frozen=True)
class HealthyConfig:
    """One healthy training setup of the corpus."""

    name: str
    """Unique name (the `--configs` glob matches it)."""
    family: str
    """Model family (`families.FAMILIES`)."""
    depth: int = 4
    """Transformer blocks."""
    width: int = 48
    """Residual width d_model."""
    heads: int = 4
    """Query heads."""
    kv_heads: int | None = None
    """Key/value heads (GQA when fewer than `heads`); None: `heads`."""
    placement: str = "pre"
    """Norm placement: pre, post (always with warmup) or sandwich."""
    init: str = "native"
    """Weight init (`inits.INITS`)."""
    optimizer: str = "adamw"
    """Optimizer (`optim.OPTIMIZERS`)."""
    lr: float = 1e-3
    """Peak learning rate (AdamW's, with Muon)."""
    muon_lr: float = 0.02
    """Muon's peak learning rate on the hidden matrices (optimizer ``muon`` only)."""
    schedule: str = "cosine"
    """Learning-rate schedule after the warmup (`optim.SCHEDULES`)."""
    warmup: int = 20
    """Linear warmup steps (of `steps`; scaled when a run is made shorter or longer)."""
    clip: float | None = 1.0
    """Gradient-norm clipping threshold; None: no clipping."""
    accum: int = 1
    """Micro-batches per optimizer step (gradient accumulation)."""
    bf16: bool = False
    """bf16 autocast on the CPU for the forward."""
    batch: int = 8
    """Sequences per micro-batch."""
    seq: int = 64
    """Sequence length."""
    data: str = "text"
    """``text`` (embedded English bytes, vocab 256) or ``zipf`` (synthetic Zipf language, vocab 512)."""
    monitor: str = "default"
    """``default`` (`MonitorConfig()`) or ``full`` (`MonitorConfig.full()`)."""
    steps: int = 200
    """Optimizer steps."""
    seed: int = 0
    """Seed of the init and the batches."""
    tags: tuple[str, ...] = field(default=())
    """Free labels (``ci``: in the CI subset)."""

    def __post_init__(self) -> None:
        for name, allowed in (
            ("family", FAMILIES), ("placement", PLACEMENTS), ("init", INITS), ("optimizer", OPTIMIZERS),
            ("schedule", SCHEDULES), ("data", DATA), ("monitor", MONITORS),
        ):  # fmt: skip
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"HealthyConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}"
                )
        if self.placement == "post" and self.warmup < 1:
            raise ValueError(f"{self.name}: a post-norm run of the healthy corpus needs a warmup")
        for name in ("depth", "width", "heads", "accum", "batch", "seq", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"HealthyConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.width % self.heads or (self.kv_heads and self.heads % self.kv_heads):
            raise ValueError(f"{self.name}: heads must divide width and kv_heads divide heads")

    def with_steps(self, steps: int) -> HealthyConfig:
        """The same setup over `steps` optimizer steps, its warmup scaled alike (at least 1 when it had one)."""
        warmup = max(1, round(self.warmup * steps / self.steps)) if self.warmup else 0
        return replace(self, steps=steps, warmup=min(warmup, steps))

    def describe(self) -> str:
        """One line for listings."""
        extras = [
            f"clip {self.clip:g}" if self.clip else "no clip",
            *(["accum 2"] if self.accum > 1 else []),
            *(["bf16"] if self.bf16 else []),
        ]
        kv = f"/{self.kv_heads}kv" if self.kv_heads and self.kv_heads != self.heads else ""
        return (
            f"{self.family} L{self.depth} d{self.width} h{self.heads}{kv} {self.placement}-norm {self.init} init, "
            f"{self.optimizer} lr {self.lr:g} {self.schedule} (warmup {self.warmup}), {', '.join(extras)}, "
            f"batch {self.batch}×{self.seq} {self.data}, {self.monitor} monitor, {self.steps} steps"
        )


C = HealthyConfig
CI = ("ci",)
PLANT = ("plant",)

CORPUS: tuple[HealthyConfig, ...] = (
    # the reference GPT (Wortsman init unless said), pre/post/sandwich, depths 2-24
    C("ref-pre-l2", "ref_gpt", depth=2, width=64, lr=3e-3, tags=CI),
    C("ref-pre-l4-scaled-wsd", "ref_gpt", depth=4, init="scaled", lr=3e-3, schedule="wsd", clip=None, batch=16, seq=32),
    C("ref-sandwich-l6-zipf", "ref_gpt", depth=6, width=32, placement="sandwich", lr=2e-3, data="zipf"),
    C("ref-post-l4-warmup", "ref_gpt", depth=4, width=32, placement="post", lr=1e-3, warmup=40, tags=PLANT),
    C("ref-pre-l12-mup-invsqrt", "ref_gpt", depth=12, width=32, init="mup", lr=3e-3, schedule="invsqrt", batch=4, seq=32),
    C("ref-pre-l24-scaled", "ref_gpt", depth=24, width=32, init="scaled", lr=2e-3, warmup=30, batch=4, seq=32),
    C("ref-pre-l8-muon", "ref_gpt", depth=8, width=32, optimizer="muon", lr=3e-3, batch=4, seq=32),
    C("ref-pre-l6-torch-init", "ref_gpt", depth=6, width=32, init="torch", batch=8, seq=32),
    C("ref-pre-l4-full-zipf", "ref_gpt", depth=4, width=32, lr=3e-3, data="zipf", monitor="full"),
    # a user's own pre-norm GPT with PyTorch's default init
    C("tiny-pre-l2-constant", "tiny_gpt", depth=2, width=64, schedule="constant", warmup=0, clip=None, tags=CI),
    C("tiny-pre-l4", "tiny_gpt", depth=4, width=64, tags=CI),
    C("tiny-pre-l8-wsd", "tiny_gpt", depth=8, width=48, schedule="wsd", batch=4, seq=32, tags=PLANT),
    C("tiny-pre-l12", "tiny_gpt", depth=12, width=32, batch=4, seq=32),
    C("tiny-pre-l24", "tiny_gpt", depth=24, width=32, lr=5e-4, warmup=30, batch=4, seq=32),
    C("tiny-pre-l4-sgd", "tiny_gpt", depth=4, width=48, optimizer="sgd", lr=0.3, schedule="constant", warmup=10),
    C("tiny-pre-l4-adafactor", "tiny_gpt", depth=4, width=48, optimizer="adafactor", lr=1e-2, schedule="invsqrt", tags=PLANT),
    C("tiny-pre-l4-adam-eps", "tiny_gpt", depth=4, width=48, optimizer="adam_eps", schedule="warmup", warmup=30),
    C("tiny-pre-l6-bf16", "tiny_gpt", depth=6, width=48, bf16=True, batch=4),
    C("tiny-pre-l4-accum", "tiny_gpt", depth=4, width=32, accum=2, batch=4, seq=32, tags=CI),
    C("tiny-post-l4-warmup", "tiny_gpt", depth=4, width=48, placement="post", lr=5e-4, warmup=50),
    C("tiny-sandwich-l4", "tiny_gpt", depth=4, width=48, placement="sandwich"),
    C("tiny-pre-l4-muon", "tiny_gpt", depth=4, width=48, optimizer="muon", schedule="wsd"),
    C("tiny-pre-l4-zipf-full", "tiny_gpt", depth=4, width=32, data="zipf", monitor="full", batch=16, seq=32, tags=PLANT),
    C("tiny-pre-l2-batch64", "tiny_gpt", depth=2, width=32, batch=64, seq=32, clip=None),
    C("tiny-pre-l16-scaled", "tiny_gpt", depth=16, width=32, init="scaled", batch=4, seq=32),
    C("tiny-pre-l6-torch-init-mup", "tiny_gpt", depth=6, width=64, init="mup", lr=3e-3, batch=4),
    # nn.TransformerEncoder with a causal mask
    C("encoder-post-l4-warmup", "torch_encoder", depth=4, width=48, placement="post", lr=5e-4, warmup=50, tags=PLANT),
    C("encoder-pre-l6", "torch_encoder", depth=6, width=32, batch=8, seq=32),
    # Hugging Face models from their config classes
    C("gpt2-l4", "hf_gpt2", depth=4, width=48, lr=2e-3, warmup=60, tags=CI),
    C("gpt2-l12-full", "hf_gpt2", depth=12, width=32, monitor="full", batch=4, seq=32),
    C("gpt2-l6-adafactor", "hf_gpt2", depth=6, width=32, optimizer="adafactor", lr=1e-2, schedule="wsd"),
    C("llama-l6-gqa", "hf_llama", depth=6, width=48, kv_heads=2, lr=2e-3),
    C("llama-l6-gqa-muon", "hf_llama", depth=6, width=48, kv_heads=2, optimizer="muon", lr=2e-3),
    C("llama-l4-bf16-accum", "hf_llama", depth=4, width=32, kv_heads=1, bf16=True, accum=2, batch=4, seq=32, tags=PLANT),
    C("llama-l2-sgd-zipf", "hf_llama", depth=2, width=32, optimizer="sgd", lr=0.3, data="zipf", clip=1.0),
    # mixtures of experts with a per-layer balancing loss (families.balancing_loss), 400 steps: long enough
    # for the MoE detectors' windows (expert collapse holds 200 steps, a dead expert 100)
    C("qwen2moe-l2", "hf_qwen2_moe", depth=2, width=32, kv_heads=2, lr=2e-3, batch=8, seq=32, steps=400, tags=PLANT),
    C("qwen2moe-l4-zipf-full", "hf_qwen2_moe", depth=4, width=32, kv_heads=2, data="zipf", monitor="full", batch=4, seq=32, steps=400),
    C("mixtral-l4-zipf-full", "hf_mixtral", depth=4, width=32, kv_heads=2, data="zipf", monitor="full", batch=8, seq=32, steps=400),
    C("mixtral-l2", "hf_mixtral", depth=2, width=32, kv_heads=2, lr=2e-3, batch=8, seq=32, steps=400),
    C("olmoe-l2", "hf_olmoe", depth=2, width=32, kv_heads=2, lr=2e-3, batch=8, seq=32, steps=400, tags=CI),
    C("olmoe-l4-muon", "hf_olmoe", depth=4, width=32, kv_heads=2, optimizer="muon", lr=2e-3, batch=8, seq=32, steps=400),
)  # fmt: skip
"""The corpus, in a fixed order."""


def select(pattern: str | None = None, tag: str | None = None) -> list[HealthyConfig]:
    """Configs whose name matches the glob `pattern` (comma-separated globs allowed) and carry `tag`."""
    globs = [g.strip() for g in (pattern or "*").split(",") if g.strip()]
    return [
        c
        for c in CORPUS
        if any(fnmatch.fnmatchcase(c.name, g) for g in globs) and (tag is None or tag in c.tags)
    ]


def by_name(name: str) -> HealthyConfig:
    """The corpus entry called `name`."""
    for c in CORPUS:
        if c.name == name:
            return c
    raise KeyError(f"no healthy config named {name!r}; `stabkit alarms --list` names them")
