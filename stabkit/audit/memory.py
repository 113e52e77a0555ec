"""Memory summary: parameters by kind and dtype, and the KV cache for the attention layout found.

Computed once per `stabkit.audit` call from shapes and dtypes only (meta-device models work).
KV cache per token = Σ over layers of 2 · kv_heads · head_dim · bytes_per_element (K and V).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..discovery import ModelMap
from .context import AuditContext
from .format import markdown_table

PARAM_KINDS = ("embedding", "attention", "mlp", "norm", "head", "other")


@dataclass
class KVCache:
    """KV-cache size of the model as built, and what MHA (kv_heads = heads) would cost."""

    layout: str
    """'MHA', 'GQA', 'MQA', 'mixed' or 'unknown'."""
    layers: int
    kv_heads: int | None
    n_heads: int | None
    head_dim: int | None
    dtype: str
    bytes_per_element: int
    bytes_per_token: int
    mha_bytes_per_token: int
    seq_len: int | None
    bytes_at_seq_len: int | None
    """bytes_per_token · seq_len (batch 1)."""
    mha_bytes_at_seq_len: int | None

    @property
    def saving(self) -> float:
        """How many times smaller than MHA (1.0 for MHA)."""
        return self.mha_bytes_per_token / self.bytes_per_token if self.bytes_per_token else 1.0


@dataclass
class MemorySummary:
    """Parameters by kind (count and bytes by dtype) and the KV cache."""

    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    """kind -> {'count': n, 'bytes': {dtype: bytes}}; tied weights counted once."""
    total_params: int = 0
    total_bytes: int = 0
    kv_cache: KVCache | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        out = asdict(self)
        if self.kv_cache is not None:
            out["kv_cache"]["saving_vs_mha"] = round(self.kv_cache.saving, 3)
        return out

    def _rows(self) -> list[tuple[str, str, str]]:
        return [
            (kind, f"{v['count']:,}", ", ".join(f"{human(b)} {dt}" for dt, b in v["bytes"].items()) or "-")
            for kind, v in self.params.items()
        ]

    def _kv_lines(self) -> list[str]:
        kv = self.kv_cache
        if kv is None:
            return ["KV cache: unknown (heads or head_dim not found)"]
        lines = [
            f"KV cache ({kv.layout}: {kv.layers} layers × {kv.kv_heads} kv heads × head_dim {kv.head_dim} × 2 "
            f"× {kv.bytes_per_element} B {kv.dtype}): {kv.bytes_per_token:,} B/token"
            + (
                f", {human(kv.bytes_at_seq_len)} at seq_len {kv.seq_len} (batch 1)"
                if kv.bytes_at_seq_len
                else ""
            )
        ]
        if kv.layout != "MHA":
            lines.append(
                f"  MHA ({kv.n_heads} kv heads) would need {kv.mha_bytes_per_token:,} B/token"
                + (
                    f", {human(kv.mha_bytes_at_seq_len)} at seq_len {kv.seq_len}"
                    if kv.mha_bytes_at_seq_len
                    else ""
                )
                + f": {kv.layout} saves {kv.saving:.1f}×"
            )
        return lines

    def to_text(self) -> str:
        """Plain-text summary."""
        lines = [f"memory: {self.total_params:,} parameters, {human(self.total_bytes)}"]
        lines += [f"  {k:<10} {n:>16}  {b}" for k, n, b in self._rows()]
        lines += self._kv_lines() + [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_markdown(self) -> str:
        """Markdown summary (TensorBoard text)."""
        head = f"**memory**: {self.total_params:,} parameters, {human(self.total_bytes)}"
        table = markdown_table(("kind", "parameters", "bytes"), self._rows())
        return "\n\n".join([head, table, *self._kv_lines(), *(f"note: {n}" for n in self.notes)])


def human(n: int | None) -> str:
    """Bytes in binary units."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{n} B"


def param_kind(ctx: AuditContext, name: str) -> str:
    """Kind of one parameter: embedding, attention, mlp, norm, head or other."""
    owner = ctx.owner_path(name)
    mmap = ctx.mmap
    if owner in mmap.embeddings:
        return "embedding"
    if ctx.is_norm_path(owner):
        return "norm"
    if owner == mmap.output_head:
        return "head"
    block = ctx.block(name)
    if block is not None:
        if block.attention is None:
            return "mlp" if block.mlp and (name == block.mlp or name.startswith(block.mlp + ".")) else "other"
        att = block.attention.path
        return "attention" if name == att or name.startswith(att + ".") else "mlp"
    return "other"


def kv_cache(mmap: ModelMap, bytes_per_element: int, dtype: str, seq_len: int | None) -> KVCache | None:
    """KV cache of the blocks in `mmap`; None when some block lacks kv_heads or head_dim."""
    atts = [b.attention for b in mmap.attention_blocks if b.attention is not None]
    if not atts or any(a.n_kv_heads is None or a.head_dim is None or a.n_heads is None for a in atts):
        return None
    per_token = sum(2 * int(a.n_kv_heads or 0) * int(a.head_dim or 0) * bytes_per_element for a in atts)
    mha = sum(2 * int(a.n_heads or 0) * int(a.head_dim or 0) * bytes_per_element for a in atts)
    layouts = {a.layout for a in atts}
    first = atts[0]
    return KVCache(
        layout=layouts.pop() if len(layouts) == 1 else "mixed",
        layers=len(atts),
        kv_heads=first.n_kv_heads,
        n_heads=first.n_heads,
        head_dim=first.head_dim,
        dtype=dtype,
        bytes_per_element=bytes_per_element,
        bytes_per_token=per_token,
        mha_bytes_per_token=mha,
        seq_len=seq_len,
        bytes_at_seq_len=per_token * seq_len if seq_len else None,
        mha_bytes_at_seq_len=mha * seq_len if seq_len else None,
    )


def _kv_dtype(ctx: AuditContext) -> torch.dtype:
    if ctx.kv_dtype is not None:
        return ctx.kv_dtype
    a = ctx.mmap.first_attention
    for path in (a.k, a.qkv) if a else ():
        mod = ctx.modules.get(path or "")
        weight = getattr(mod, "weight", None)
        if isinstance(weight, torch.Tensor):
            return weight.dtype
    return next((p.dtype for p in ctx.model.parameters() if p.is_floating_point()), torch.float32)


def summarize(ctx: AuditContext) -> MemorySummary:
    """Count parameters by kind and dtype (tied weights once) and size the KV cache."""
    summary = MemorySummary(params={k: {"count": 0, "bytes": {}} for k in PARAM_KINDS})
    for name, p in ctx.model.named_parameters():  # remove_duplicate=True: tied weights once
        entry = summary.params[param_kind(ctx, name)]
        nbytes = p.numel() * p.element_size()
        entry["count"] += p.numel()
        dt = str(p.dtype).replace("torch.", "")
        entry["bytes"][dt] = entry["bytes"].get(dt, 0) + nbytes
        summary.total_params += p.numel()
        summary.total_bytes += nbytes
    head = ctx.module(ctx.mmap.output_head)
    emb = ctx.module(ctx.mmap.embeddings[0]) if ctx.mmap.embeddings else None
    if head is not None and emb is not None and getattr(head, "weight", None) is getattr(emb, "weight", 0):
        summary.notes.append(
            f"{ctx.mmap.output_head} is tied to {ctx.mmap.embeddings[0]} (counted once, as embedding)"
        )
    dtype = _kv_dtype(ctx)
    seq_len = ctx.seq_len if ctx.seq_len is not None else ctx.context_length()
    if ctx.seq_len is None and seq_len is not None:
        summary.notes.append(f"seq_len not given: KV cache sized at the model's context length {seq_len}")
    summary.kv_cache = kv_cache(ctx.mmap, dtype.itemsize, str(dtype).replace("torch.", ""), seq_len)
    return summary
