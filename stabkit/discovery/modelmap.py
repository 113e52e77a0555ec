"""The ModelMap: where the roles of a Transformer sit in a particular model.

Built once by `stabkit.inspect_model` (before training); read by probes, audit and interventions.
All module references are `named_modules()` paths relative to the model root.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import torch

from ..moe.map import MoEMap

Placement = Literal["pre", "post", "sandwich", "output", "unknown"]
"""Where a block's norms sit: 'pre' x + f(norm(x)); 'post' norm(x + f(x)); 'sandwich'
x + norm_out(f(norm_in(x))); 'output' x + norm_out(f(x)) (OLMo 2); 'unknown'."""


class DiscoveryError(ValueError):
    """Raised when a model's Transformer structure cannot be found (only where an answer is needed:
    `inspect_model` by names, strict mode, an intervention that needs the role)."""


OPAQUE = "opaque"
"""`AttentionMap.impl` of an attention module whose traced forward made no call stabkit can read
(an unregistered custom kernel): not watched by the attention probe."""


@dataclass
class QKPart:
    """The head-dim positions of a query or key that one projection makes, when q or k is built from
    several projections (latent attention, MLA: a "nope" part per head and a rotary part shared by
    the heads)."""

    source: str
    """The projection: a module path (its output), or a parameter name when `weight` is True."""
    dims: list[int]
    """Positions along the head dim this part makes."""
    columns: list[list[int]]
    """Per head (query heads for q; key heads as the call sees them for k), the output features of
    `source` that make `dims`, in `dims` order."""
    weight: bool = False
    """`source` is a parameter used by a projection op inside a forward (no module outputs it)."""
    axis: int | None = None
    """With `weight`: the parameter's axis indexing the output features (None: unknown)."""
    shared: bool = False
    """Every head reads the same features (MLA's rotary key)."""


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
    """How it computes attention: 'sdpa', 'eager', 'torch_mha', 'kernel:<name>' (flash-attn,
    FlexAttention, ...: `stabkit.attention.kernels`), 'hf:<attn_implementation>', 'opaque' (traced:
    no call stabkit can read) or 'unknown' (named, not traced)."""
    cross: bool = False
    """True for cross-attention (keys from another sequence, e.g. the encoder output)."""
    q_columns: list[list[int]] | None = None
    """Traced: per query head, the output features of `q` (or `qkv`) that make it, in head-dim order."""
    k_columns: list[list[int]] | None = None
    """Traced: per key head, the output features of `k` (or `qkv`) that make it."""
    qk_norm: str | None = None
    """Path of a norm the model applies to q/k itself (its own QK-norm), when traced."""
    q_weight: str | None = None
    """Traced: the parameter of the projection op making q, when q is not a module's output
    (``einsum(x, self.W_Q)`` inside a forward); `q_columns` index its output."""
    k_weight: str | None = None
    q_site: str | None = None
    """The module whose forward makes the q projection op (with `q_weight`)."""
    k_site: str | None = None
    q_weight_axis: int | None = None
    """Traced: the axis of `q_weight` indexing the op's output features (None: unknown)."""
    k_weight_axis: int | None = None
    q_parts: list[QKPart] | None = None
    """Traced, when q or k is made from several projections (MLA): q by part — one per (q projection,
    k part) pair, so each q part meets one key part (its `dims`)."""
    k_parts: list[QKPart] | None = None
    """Traced, with `q_parts`: k by projection (MLA: the per-head "nope" rows of ``kv_b_proj`` and the
    shared rotary rows of ``kv_a_proj_with_mqa``)."""
    qk_note: str = ""
    """Why q/k rows are unknown, when they are."""
    qk_mixed: bool = False
    """Traced: an op mixes q's or k's features between their projection and the call (a model's own
    l2 QK-norm, say): q/k are not plain slices of one projection."""
    found: str = "named"
    """How it was found: 'traced' (seen in a forward), 'named' (module names) or 'hint'."""
    output: str | None = None
    """Module whose output is the attention sub-layer's output before the residual add, when that is
    not the attention module itself (Bloom adds the residual inside it: its output projection)."""
    softmax_shift: bool = False
    """Eager: the softmax input is the logits minus their row max (read unshifted by the probe)."""
    sink_columns: int = 0
    """Eager: the softmax input ends with this many learned sink columns per row (GPT-OSS)."""

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
    attention: AttentionMap | None
    """The block's (first) attention call site; None for a block without attention (a Mamba,
    linear-attention or convolution layer of a hybrid model)."""
    mlp: str | None = None
    """Module whose output is the MLP sub-layer's output."""
    norms: list[NormMap] = field(default_factory=list)
    placement: Placement = "unknown"
    """Norm placement of the block as a whole."""
    attentions: list[AttentionMap] = field(default_factory=list)
    """Every attention call site in the block (self first, then cross); `attention` is the first."""
    parallel: bool = False
    """Parallel residual: the MLP reads the block input, not the attention's output (GPT-J, Cohere)."""
    mixer: str | None = None
    """A block without attention: its token-mixing module (Mamba, linear attention, convolution), if named."""

    def __post_init__(self) -> None:
        if not self.attentions and self.attention is not None:
            self.attentions = [self.attention]


@dataclass
class LogitsMap:
    """Where the model's final output logits are read (and changed, by z_loss / logit_softcap)."""

    path: str
    """Module whose output holds the final logits ('' = the model's own output)."""
    key: str | int | None = None
    """How to take them from that output: None (the output itself when it is a tensor, else its
    ``.logits``), an attribute/key name, or a tuple index."""
    found: str = "named"
    """'traced', 'named' or 'hint'."""

    def take(self, output: Any) -> Any:
        """The logits in `output` (the output of the module at `path`), or None when absent."""
        if self.key is None:
            return output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
        if isinstance(self.key, int):
            return output[self.key] if isinstance(output, tuple | list) and len(output) > self.key else None
        if isinstance(output, dict) and self.key in output:
            return output[self.key]
        return getattr(output, self.key, None)

    def replace(self, output: Any, logits: Any) -> Any:
        """`output` with its logits replaced by `logits` (for forward hooks that change them)."""
        if self.key is None and isinstance(output, torch.Tensor):
            return logits
        key = "logits" if self.key is None else self.key
        if isinstance(key, int):
            items = list(output)
            items[key] = logits
            return type(output)(items) if isinstance(output, list) else tuple(items)
        if isinstance(output, dict):
            output[key] = logits  # HF ModelOutput: the attribute follows the key
        if hasattr(output, key):
            setattr(output, key, logits)
        return output


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
    logits: LogitsMap | None = None
    """Where the final logits are (None: the model returns no logits, e.g. a bare encoder)."""
    found: dict[str, str] = field(default_factory=dict)
    """Role -> how it was found ('traced', 'named', 'hint')."""
    gaps: list[str] = field(default_factory=list)
    """What discovery could not find, each with how to supply it (said once at attach; strict raises)."""
    moe: list[MoEMap] = field(default_factory=list)
    """The mixture-of-experts layers (router, E, k, experts, where the routing is read), in the order
    they ran (`stabkit.moe.find`); empty for a dense model."""

    @property
    def block_paths(self) -> list[str]:
        """Paths of the blocks, in order."""
        return [b.path for b in self.blocks]

    @property
    def attention_paths(self) -> list[str]:
        """Paths of every attention call site (self and cross), in block order, each once."""
        return list(dict.fromkeys(a.path for b in self.blocks for a in b.attentions))

    @property
    def attentions(self) -> list[AttentionMap]:
        """Every attention call site, in block order."""
        return [a for b in self.blocks for a in b.attentions]

    @property
    def attention_blocks(self) -> list[BlockMap]:
        """The blocks that attend (a hybrid model also has blocks without attention)."""
        return [b for b in self.blocks if b.attention is not None]

    @property
    def first_attention(self) -> AttentionMap | None:
        """The first block's attention (the model's typical one), or None when no block attends."""
        blocks = self.attention_blocks
        return blocks[0].attention if blocks else None

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
        if self.found:
            lines.append("found: " + ", ".join(f"{k} {v}" for k, v in self.found.items()))
        lines.append(f"embeddings: {', '.join(self.embeddings) or '-'}")
        for b in self.blocks:
            parallel = ", parallel residual" if b.parallel else ""
            lines.append(f"block {b.index}: {b.path}  [{b.placement}-norm{parallel}]")
            if b.attention is None:
                lines.append(f"  no attention (token mixer: {b.mixer or 'unknown'})")
            for a in b.attentions:
                if a.qkv:
                    proj = f"qkv={a.qkv} ({a.qkv_layout})"
                else:
                    proj = f"q={a.q} k={a.k} v={a.v}"
                kind = "cross-attention" if a.cross else "attention"
                extra = f", own qk-norm {a.qk_norm}" if a.qk_norm else ""
                lines.append(
                    f"  {kind}: {a.path or '<root>'}  {proj} out={a.out}  heads={a.n_heads} "
                    f"kv_heads={a.n_kv_heads} head_dim={a.head_dim} ({a.layout}, {a.impl}{extra}) [{a.found}]"
                )
            lines.append(f"  mlp: {b.mlp}")
            lines.extend(m.describe() for m in self.moe if self.block_of(m.path) == b.path)
            for n in b.norms:
                lines.append(f"  norm: {n.path} ({n.kind}, {n.position} {n.sublayer})")
        lines.append(f"final norm: {self.final_norm}")
        lines.append(f"output head: {self.output_head}")
        if self.logits is not None:
            where = self.logits.path or "<model output>"
            key = f" [{self.logits.key!r}]" if self.logits.key is not None else ""
            lines.append(f"logits: {where}{key} ({self.logits.found})")
        lines.extend(m.describe() for m in self.moe if self.block_of(m.path) is None)
        lines.extend(f"note: {n}" for n in self.notes)
        lines.extend(f"gap: {g}" for g in self.gaps)
        return "\n".join(lines)

    def under(self, prefix: str) -> ModelMap:
        """This map (found on the submodule at `prefix`) with every path made relative to the root."""
        if not prefix:
            return self

        def j(path: str | None) -> str | None:
            if path is None:
                return None
            return f"{prefix}.{path}" if path else prefix

        def part(p: QKPart) -> QKPart:
            return replace(p, source=j(p.source) or prefix)

        def attn(a: AttentionMap | None) -> AttentionMap | None:
            if a is None:
                return None
            return replace(
                a,
                path=j(a.path) or prefix,
                q=j(a.q),
                k=j(a.k),
                v=j(a.v),
                qkv=j(a.qkv),
                out=j(a.out),
                qk_norm=j(a.qk_norm),
                output=j(a.output),
                q_weight=j(a.q_weight),
                k_weight=j(a.k_weight),
                q_site=j(a.q_site) if a.q_site is not None else None,
                k_site=j(a.k_site) if a.k_site is not None else None,
                q_parts=[part(p) for p in a.q_parts] if a.q_parts is not None else None,
                k_parts=[part(p) for p in a.k_parts] if a.k_parts is not None else None,
            )

        blocks = []
        for b in self.blocks:
            attns = [a for a in (attn(x) for x in b.attentions) if a is not None]
            blocks.append(
                replace(
                    b,
                    path=j(b.path) or prefix,
                    attention=attns[0] if attns else None,
                    attentions=attns,
                    mlp=j(b.mlp),
                    mixer=j(b.mixer),
                    norms=[replace(n, path=j(n.path) or prefix) for n in b.norms],
                )
            )
        logits = replace(self.logits, path=j(self.logits.path) or prefix) if self.logits else None
        return replace(
            self,
            blocks=blocks,
            final_norm=j(self.final_norm),
            output_head=j(self.output_head),
            embeddings=[j(e) or prefix for e in self.embeddings],
            logits=logits,
            moe=[m.under(prefix) for m in self.moe],
            notes=[*self.notes, f"traced the submodule {prefix!r} (the model's own forward did not run)"],
        )
