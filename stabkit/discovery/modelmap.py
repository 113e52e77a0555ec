"""The ModelMap: where the roles of a Transformer sit in a particular model.

Built once by `stabkit.inspect` (before training); read by probes, audit and interventions.
All module references are `named_modules()` paths relative to the model root.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Placement = Literal["pre", "post", "sandwich", "unknown"]


class DiscoveryError(ValueError):
    """Raised when a model's Transformer structure cannot be found."""


@dataclass
class AttentionMap:
    """One attention module and its projections."""

    path: str
    """Path of the attention module."""
    q: str | None = None
    """Separate query projection (None when fused)."""
    k: str | None = None
    """Separate key projection."""
    v: str | None = None
    """Separate value projection."""
    qkv: str | None = None
    """Fused q/k/v projection (module path, or ``<path>.in_proj_weight`` for nn.MultiheadAttention)."""
    qkv_layout: str | None = None
    """How the fused output splits: 'q|k|v' = concatenated [q, k, v] on the output features."""
    out: str | None = None
    """Output projection."""
    n_heads: int | None = None
    """Number of query heads."""
    n_kv_heads: int | None = None
    """Number of key/value heads (< n_heads: GQA; 1: MQA)."""
    head_dim: int | None = None
    """Width of one head."""
    impl: str = "unknown"
    """How it computes attention: 'sdpa', 'eager', 'torch_mha', 'hf:<attn_implementation>' or 'unknown'."""

    @property
    def layout(self) -> str:
        """'MHA', 'GQA', 'MQA' or 'unknown'."""
        if self.n_heads is None or self.n_kv_heads is None:
            return "unknown"
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else "GQA"


@dataclass
class NormMap:
    """One normalisation layer inside a block."""

    path: str
    kind: str
    """'layernorm', 'rmsnorm' or the class name."""
    sublayer: str
    """'attn' or 'mlp' (the sub-layer it guards), or 'unknown'."""
    position: str
    """'pre' (on the sub-layer input), 'post' (after the residual add), 'sandwich' (on the sub-layer output, before the add)."""


@dataclass
class BlockMap:
    """One Transformer block."""

    index: int
    path: str
    attention: AttentionMap
    mlp: str | None = None
    """Module whose output is the MLP sub-layer's output."""
    norms: list[NormMap] = field(default_factory=list)
    placement: Placement = "unknown"
    """Norm placement of the block as a whole."""


@dataclass
class ModelMap:
    """The roles found in one model."""

    family: str
    """Which discovery rule matched: 'stabkit-gpt', 'nanogpt', 'hf-gpt2', 'hf-llama', 'torch-encoder', 'fallback', 'override'."""
    blocks: list[BlockMap]
    final_norm: str | None = None
    output_head: str | None = None
    embeddings: list[str] = field(default_factory=list)
    d_model: int | None = None
    vocab_size: int | None = None
    notes: list[str] = field(default_factory=list)
    """What discovery had to guess."""

    @property
    def block_paths(self) -> list[str]:
        """Paths of the blocks, in order."""
        return [b.path for b in self.blocks]

    @property
    def attention_paths(self) -> list[str]:
        """Paths of the attention modules, in block order."""
        return [b.attention.path for b in self.blocks]

    def block_of(self, path: str) -> str | None:
        """The path of the block that contains `path` (a module or parameter name), if any."""
        for b in self.blocks:
            if path == b.path or path.startswith(b.path + "."):
                return b.path
        return None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)

    def describe(self) -> str:
        """A human-readable table of the map (what `stabkit inspect` prints)."""
        lines = [f"family: {self.family}   d_model: {self.d_model}   vocab: {self.vocab_size}"]
        lines.append(f"embeddings: {', '.join(self.embeddings) or '-'}")
        for b in self.blocks:
            a = b.attention
            if a.qkv:
                proj = f"qkv={a.qkv} ({a.qkv_layout})"
            else:
                proj = f"q={a.q} k={a.k} v={a.v}"
            lines.append(f"block {b.index}: {b.path}  [{b.placement}-norm]")
            lines.append(
                f"  attention: {a.path}  {proj} out={a.out}  heads={a.n_heads} kv_heads={a.n_kv_heads} "
                f"head_dim={a.head_dim} ({a.layout}, {a.impl})"
            )
            lines.append(f"  mlp: {b.mlp}")
            for n in b.norms:
                lines.append(f"  norm: {n.path} ({n.kind}, {n.position} {n.sublayer})")
        lines.append(f"final norm: {self.final_norm}")
        lines.append(f"output head: {self.output_head}")
        lines.extend(f"note: {n}" for n in self.notes)
        return "\n".join(lines)
