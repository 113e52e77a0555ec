"""Configuration of the reference GPT (`stabkit.harness.models.GPT`).

The config is read once, when the model is built; every variant switch a recipe needs
(norm placement, norm kind, MLP kind, positions, QK-norm, soft caps, GQA) lives here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal

NormPlacement = Literal["pre", "post", "sandwich"]
NormKind = Literal["layernorm", "rmsnorm"]
MLPKind = Literal["gelu", "swiglu"]
PositionKind = Literal["learned", "rope"]
AttentionKind = Literal["sdpa", "eager"]

_CHOICES: dict[str, tuple[str, ...]] = {
    "norm_placement": ("pre", "post", "sandwich"),
    "norm": ("layernorm", "rmsnorm"),
    "mlp": ("gelu", "swiglu"),
    "positions": ("learned", "rope"),
    "attention": ("sdpa", "eager"),
}


@dataclass
class GPTConfig:
    """Shape and variant switches of the reference decoder-only Transformer."""

    vocab_size: int = 256
    """Vocabulary size (256 = raw bytes, the embedded data's alphabet)."""
    context: int = 64
    """Maximum sequence length T."""
    d_model: int = 64
    """Width of the residual stream."""
    n_layers: int = 2
    """Number of Transformer blocks."""
    n_heads: int = 4
    """Number of query heads; must divide d_model."""
    n_kv_heads: int | None = None
    """Key/value heads (GQA when < n_heads, MQA when 1); None means n_heads (MHA)."""
    d_ff: int | None = None
    """MLP hidden width; None means 4·d_model (gelu) or 8/3·d_model rounded up to 8 (swiglu)."""
    norm_placement: NormPlacement = "pre"
    """pre: x + f(norm(x)); post: norm(x + f(x)); sandwich: x + norm_out(f(norm_in(x)))."""
    norm: NormKind = "layernorm"
    """Normalisation layer kind."""
    mlp: MLPKind = "gelu"
    """MLP kind: GELU with one hidden layer, or gated SwiGLU."""
    positions: PositionKind = "learned"
    """Learned absolute position embeddings, or rotary embeddings (RoPE) on q and k."""
    rope_base: float = 10000.0
    """RoPE frequency base."""
    bias: bool = False
    """Biases in linear layers and LayerNorms."""
    norm_eps: float = 1e-6
    """Epsilon of every norm (Wortsman et al. 2023 use 1e-6)."""
    init_std: float | None = None
    """None: Wortsman init (embeddings 1/√d, other weights 1/√fan_in); a float: N(0, std) everywhere."""
    qk_norm: bool = False
    """Per-head normalisation (same kind as `norm`) of q and k before RoPE and the dot product."""
    attention: AttentionKind = "sdpa"
    """sdpa: F.scaled_dot_product_attention (fused; on a CPU it keeps q·kᵀ in fp32 under autocast);
    eager: (q @ kᵀ)·scale materialised in the autocast dtype, as Hugging Face's eager attention (fp16 can
    overflow to Inf there). attn_softcap and softmax_fp32 use the eager path whatever this says."""
    softmax_fp32: bool = False
    """Eager path with the logits and softmax in float32 (q.float() @ k.float()ᵀ, autocast off), weights
    cast back to v's dtype: the fp32-softmax fix for low precision (forces the eager path)."""
    attn_softcap: float | None = None
    """cap·tanh(logits/cap) on attention logits (Gemma 2 uses 50); forces the eager attention path."""
    logit_softcap: float | None = None
    """cap·tanh(logits/cap) on the output logits (Gemma 2 uses 30)."""
    tie_embeddings: bool = False
    """Share the token embedding with the output head."""
    dropout: float = 0.0
    """Dropout on attention weights and sub-layer outputs."""
    n_experts: int = 0
    """0: a dense MLP per block; E >= 2: a mixture of E experts (each an MLP of `mlp` kind and
    `expert_d_ff` width) behind a top-k softmax router (`stabkit.harness.models.moe`), no balancing
    loss (switch one on with the ``load_balance_loss`` / ``aux_free_balance`` interventions)."""
    top_k: int = 2
    """k: experts each token goes to (MoE only); the chosen softmax probabilities, renormalised to sum 1,
    weigh their outputs."""
    capacity_factor: float | None = None
    """MoE only. None: every token reaches its k experts; c: each expert takes at most
    ceil(c·tokens·k/E) token slots per forward (first choices first, then in token order) and the
    rest are dropped (their slot adds nothing; the residual carries the token), as expert-parallel
    training does."""
    expert_d_ff: int | None = None
    """Hidden width of each expert; None means the dense MLP's (`ff_width`)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "context", "d_model", "n_layers", "n_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.n_heads={self.n_heads} must divide d_model={self.d_model} "
                f"(head_dim = d_model / n_heads)"
            )
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_heads % self.n_kv_heads):
            raise ValueError(
                f"GPTConfig.n_kv_heads={self.n_kv_heads} must be >= 1 and divide n_heads={self.n_heads}"
            )
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.positions == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")
        for name in ("attn_softcap", "logit_softcap", "init_std"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"GPTConfig.{name} must be None or a positive number, got {value!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.n_experts != 0 and not (isinstance(self.n_experts, int) and self.n_experts >= 2):
            raise ValueError(
                f"GPTConfig.n_experts must be 0 (dense MLP) or an integer >= 2, got {self.n_experts!r}"
            )
        if self.n_experts and not (isinstance(self.top_k, int) and 1 <= self.top_k < self.n_experts):
            raise ValueError(
                f"GPTConfig.top_k must be an integer in [1, n_experts={self.n_experts}), got {self.top_k!r}"
            )
        cf = self.capacity_factor
        if cf is not None and not (isinstance(cf, int | float) and cf > 0 and math.isfinite(cf)):
            raise ValueError(f"GPTConfig.capacity_factor must be None or a positive number, got {cf!r}")
        if self.expert_d_ff is not None and self.expert_d_ff < 1:
            raise ValueError(
                f"GPTConfig.expert_d_ff must be None or a positive integer, got {self.expert_d_ff!r}"
            )
        if self.d_ff is not None and self.d_ff < 1:
            raise ValueError(f"GPTConfig.d_ff must be None or a positive integer, got {self.d_ff!r}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads actually used."""
        return self.n_kv_heads or self.n_heads

    @property
    def ff_width(self) -> int:
        """MLP hidden width actually used."""
        if self.d_ff is not None:
            return self.d_ff
        if self.mlp == "swiglu":
            return 8 * math.ceil(8 * self.d_model / 3 / 8)
        return 4 * self.d_model

    def updated(self, **overrides: Any) -> GPTConfig:
        """A copy with some fields replaced; unknown names raise a ValueError listing the fields."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown GPTConfig field(s) {unknown}; allowed: {sorted(known)}")
        return replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (for logs and summaries)."""
        return asdict(self)
