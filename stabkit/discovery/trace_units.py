"""Blocks the traced forward shows without an attention call stabkit can read, and what to say about them.

Runs once at discovery time, after the attention call sites have given the blocks (`trace_map`):

- *opaque blocks*: repeated units of the same class as an attention block that ran without any call
  stabkit can read (an unregistered custom kernel) — attention mapped by names, impl ``"opaque"``;
- *blocks without attention*: other units in the same container that mix tokens in another way
  (a Mamba or linear-attention layer of a hybrid, a convolution): told apart from an interleaved
  feed-forward entry by a token-mixing op in their forward (a product of two activations, a
  convolution, a cumulative sum);
- *units without any attention call*: when the whole forward made none, the largest container of
  same-class units that ran is taken as the blocks, so activations, gradients and updates are still
  monitored per block.

Each gap becomes a sentence in `ModelMap.gaps` (what is missing and how to supply it); the monitor
says them once at attach (strict mode raises instead). Nothing here stops a run.
"""

from __future__ import annotations

import re
from collections import Counter

from torch import nn

from .families import family_of
from .families import mlp_path as mlp_path_by_name
from .modelmap import OPAQUE, BlockMap, ModelMap, NormMap, Placement
from .roles import find_attention, is_norm, map_attention, norm_kind
from .trace_builder import TraceBuilder

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
MIXER = re.compile(
    r"mamba|ssm|mixer|conv|linear_?attn|linear_?attention|delta|recurren|rwkv|hyena|retention|lru", re.I
)
REGISTER = (
    "stabkit.register_kernel(<op or function>, q=..., k=..., layout=..., causal=...) (docs/guide/kernels.md)"
)


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _under(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def _has_parameters(module: nn.Module) -> bool:
    return next(iter(module.parameters()), None) is not None


def mixes_tokens(b: TraceBuilder, path: str) -> bool:
    """True when the forward of `path` made a token-mixing op (see the module docstring)."""
    calls = [m for m in b.trace.modules if m.path == path]
    return any(c.start <= i < c.end for c in calls for i in b.trace.mixing)


def _mixer(block: nn.Module, path: str) -> str | None:
    """The token-mixing child of a block without attention, by name or class name."""
    for name, child in block.named_children():
        if MIXER.search(name) or MIXER.search(type(child).__name__):
            return f"{path}.{name}" if path else name
    return None


def _unit(b: TraceBuilder, path: str, attention: bool) -> BlockMap:
    """A block mapped without a readable attention call: attention by names (opaque) or none."""
    module = b.modules[path]
    rel = mlp_path_by_name(family_of(module), module)
    mlp = f"{path}.{rel}" if rel else None
    amap = None
    mixer = None
    if attention:
        attn_rel = find_attention(module)
        attn_path = f"{path}.{attn_rel}" if attn_rel else path
        amap = map_attention(b.model, attn_path)
        amap.impl, amap.found = OPAQUE, "named"
        amap.qk_note = "its forward made no attention call stabkit can read"
    else:
        mixer = _mixer(module, path)
    subs = [
        (name, *span) for name, sub in (("mixer", mixer), ("mlp", mlp)) if sub and (span := _span(b, sub))
    ]
    norms: list[NormMap]
    placement: Placement = "unknown"
    if len(subs) == 2:  # a Mamba / conv layer with its MLP: its norms placed against both
        norms, found = b.norms(path, subs, [])
        placement = found  # type: ignore[assignment]
    else:
        norms = [
            NormMap(p, norm_kind(m), "unknown", "unknown")
            for p, m in b.modules.items()
            if _under(p, path) and p != path and is_norm(m) and p.count(".") == path.count(".") + 1
        ]
    return BlockMap(
        index=0,
        path=path,
        attention=amap,
        mlp=mlp,
        norms=norms,
        placement=placement,
        mixer=mixer,
    )


def _span(b: TraceBuilder, path: str) -> tuple[int | None, int | None, int, int] | None:
    """(input id, output id, first op, last op) of the first call of the module at `path`."""
    call = next((m for m in b.trace.modules if m.path == path), None)
    return (call.input, call.output, call.start, call.end) if call is not None else None


def parallel_mixer(b: TraceBuilder, block: str, taken: list[str | None]) -> str | None:
    """A child of an attention block that mixes tokens beside the attention (Falcon-H1's Mamba): the
    attention sub-layer's output is then a sum, not the attention module's output."""
    module = b.modules[block]
    for name, child in module.named_children():
        path = f"{block}.{name}" if block else name
        if any(t is not None and (_under(t, path) or _under(path, t)) for t in taken) or is_norm(child):
            continue
        named = MIXER.search(name) or MIXER.search(type(child).__name__)  # not an MoE's expert products
        if named and _has_parameters(child) and mixes_tokens(b, path):
            return path
    return None


def other_blocks(b: TraceBuilder, blocks: list[BlockMap]) -> list[BlockMap]:
    """Opaque attention blocks and blocks without attention beside the traced ones (module docstring)."""
    known = {bm.path for bm in blocks}
    ran = {m.path for m in b.trace.modules}
    classes = {type(b.modules[bm.path]) for bm in blocks}
    out: list[BlockMap] = []
    for parent in dict.fromkeys(_parent(bm.path) for bm in blocks if bm.path):
        if not isinstance(b.modules[parent], CONTAINERS):
            continue
        for name, sibling in b.modules[parent].named_children():
            path = f"{parent}.{name}" if parent else name
            if path in known or path not in ran or not _has_parameters(sibling):
                continue
            if any(_under(k, path) or _under(path, k) for k in known):
                continue
            opaque = type(sibling) in classes and find_attention(sibling) is not None
            if opaque and not any(_under(c.scope, path) for c in b.trace.calls):
                out.append(_unit(b, path, attention=True))
                known.add(path)
            elif mixes_tokens(b, path):  # a hybrid's other layers (of its own class, or the same one)
                out.append(_unit(b, path, attention=False))
                known.add(path)
    return out


def repeated_units(b: TraceBuilder) -> list[BlockMap]:
    """When no attention call was seen at all: the largest container's same-class units that ran."""
    ran = {m.path for m in b.trace.modules}
    best: list[str] = []
    for path, module in b.modules.items():
        if not isinstance(module, CONTAINERS):
            continue
        kids = [
            (f"{path}.{n}" if path else n, c)
            for n, c in module.named_children()
            if (f"{path}.{n}" if path else n) in ran and _has_parameters(c) and next(c.children(), None)
        ]  # a unit holds sub-layers: a plain Linear of an MLP stack is no block
        if len(kids) < 2:
            continue
        kind, count = Counter(type(c) for _, c in kids).most_common(1)[0]
        if count >= 2 and count > len(best):
            best = [p for p, c in kids if type(c) is kind]
    return [_unit(b, p, attention=find_attention(b.modules[p]) is not None) for p in best]


def gaps(b: TraceBuilder, mmap: ModelMap) -> list[str]:
    """What discovery could not find in this trace, each with how to supply it."""
    out: list[str] = []
    opaque = [a.path for a in mmap.attentions if a.impl == OPAQUE]
    ops = sorted({name for name, _ in b.trace.opaque_ops})
    seen = f"; custom ops its forward called: {', '.join(ops[:4])}" if ops else ""
    if not b.trace.calls:
        out.append(
            "the traced forward made no attention call stabkit can read (F.scaled_dot_product_attention, "
            f"a softmax over q·kᵀ, nn.MultiheadAttention or a known kernel){seen}: its attention logits "
            f"are not measured. To measure them: {REGISTER}"
        )
    elif opaque:
        out.append(
            f"{len(opaque)} attention module(s) ran without a call stabkit can read ({', '.join(opaque[:4])}"
            f"{', …' if len(opaque) > 4 else ''}){seen}: their attention logits are not measured. To measure "
            f"them: {REGISTER}"
        )
    unreadable = [
        a for a in mmap.attentions if a.impl.startswith("kernel:") and a.qk_note and a.n_heads is None
    ]
    for a in unreadable[:1]:
        out.append(f"attention at {a.path!r}: {a.qk_note}")
    return out
