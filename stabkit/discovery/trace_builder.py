"""The state shared while one trace is turned into a map: the traced ops, projections and module
calls, and the questions the mapping asks of them (which module outputs a projection, does one
tensor derive from another, where are a block's norms, is there a residual add between two nodes).

Runs once at discovery time, used by `trace_map`, `trace_units` and `trace_logits`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .modelmap import AttentionMap, NormMap, QKPart
from .roles import OUT_NAMES, V_NAMES, child, is_norm, map_attention, norm_kind
from .trace import AttentionCall, ModuleCall, Projection, Trace, is_add
from .trace_heads import HeadPart, HeadSource, head_parts, head_source

_PRE = NormMap("", "", "", "pre")


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _under(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def _lineage(path: str) -> list[str]:
    """`path` and its ancestors, innermost first, without the root."""
    out = []
    while path:
        out.append(path)
        path = _parent(path)
    return out


class TraceBuilder:
    """State shared while turning one trace into a map."""

    def __init__(self, model: nn.Module, trace: Trace) -> None:
        self.model = model
        self.trace = trace
        self.modules = dict(model.named_modules())
        self.calls_by_output = {m.output: m for m in trace.modules if m.output is not None}
        self._sources: dict[tuple[int, str], HeadSource | None] = {}

    def source(self, call: AttentionCall, which: str) -> HeadSource | None:
        """The traced source of the call's queries ('q') or keys ('k'), computed once."""
        key = (call.index, which)
        if key not in self._sources:
            x = call.q if which == "q" else call.k
            self._sources[key] = head_source(self.trace, x, call.index, self.modules)
        return self._sources[key]

    # ------------------------------------------------------------------ helpers
    def module_output_of(self, proj: Projection) -> str | None:
        """The module whose output is this projection's output (nn.Linear, HF Conv1D's addmm + view),
        if any: reached from the projection through ops of one activation operand each (views, a
        bias add), never mixed with another activation (an attention module whose q projection is an
        op inside its forward does not output q)."""
        for call in self.trace.modules:
            if call.path != proj.module or not (call.start <= proj.index < call.end):
                continue
            if call.output is None:
                return None
            if self._chain(proj.output, call.output, proj.index):
                shape_in = self.trace.shapes.get(proj.output, ())
                shape_out = self.trace.shapes.get(call.output, ())
                if shape_in[-1:] == shape_out[-1:]:
                    return call.path
        return None

    def _chain(self, source: int, node: int, since: int) -> bool:
        """True when `node` is `source`, or made from it by ops whose only activation operand is it."""
        t = self.trace
        for _ in range(64):
            if node == source:
                return True
            if t.created.get(node, -1) < since:
                return False
            active = [p for p in t.parents.get(node, ()) if p not in t.param_like]
            if len(active) != 1:
                return False
            node = active[0]
        return False

    def window(self, block: str) -> tuple[int, int, ModuleCall | None]:
        """Op range of the block's (first) forward and its call record (None when it is never called)."""
        own = [m for m in self.trace.modules if m.path == block]
        if own:
            return own[0].start, own[0].end, own[0]
        inner = self.trace.calls_of(block)
        return min(m.start for m in inner), max(m.end for m in inner), None

    def derives(self, node: int | None, source: int | None, since: int) -> bool:
        return node is not None and source is not None and source in self.trace.ancestors(node, since)

    # ------------------------------------------------------------------ attention
    def attention_map(self, call: AttentionCall, block: str) -> AttentionMap:
        scope = call.scope
        module = self.modules[scope]
        if call.kind == "torch_mha":
            amap = map_attention(self.model, scope)
            amap.cross = call.query_input != call.key_input
            amap.found = "traced"
            return amap
        if call.q is None or call.k is None:  # a kernel call whose arguments could not be read
            amap = map_attention(self.model, scope, call.kind)
            amap.found, amap.qk_note = "traced", call.note
            return amap
        amap = AttentionMap(path=scope, impl=call.kind, found="traced")
        amap.softmax_shift, amap.sink_columns = call.shifted, call.sink_columns
        amap.n_heads, amap.head_dim = int(call.q.shape[1]), int(call.q.shape[-1])
        amap.n_kv_heads = int(call.k.shape[1])
        q_src, k_src = self.source(call, "q"), self.source(call, "k")
        self._projections(amap, q_src, k_src)
        if q_src is not None and k_src is not None and (q_src.parts or k_src.parts):
            self._parts(amap, call, q_src, k_src)
        if k_src is not None and k_src.projection is not None:
            amap.n_kv_heads = k_src.distinct_heads
            if k_src.plain and amap.k_columns:
                amap.k_columns = list(dict.fromkeys(tuple(c) for c in amap.k_columns))  # type: ignore[misc]
                amap.k_columns = [list(c) for c in amap.k_columns]
        if q_src is not None and k_src is not None and q_src.projection and k_src.projection:
            amap.cross = q_src.projection.input != k_src.projection.input
        else:
            amap.cross = call.q.shape[2] != call.k.shape[2]
        out = self._out_projection(call, scope, block)
        amap.out = out or (f"{scope}.{c}" if scope and (c := child(module, OUT_NAMES)) else None)
        v = child(module, V_NAMES) if scope != block else None
        if amap.q and amap.k and v:
            amap.v = f"{scope}.{v}" if scope else v
        return amap

    def _projections(self, amap: AttentionMap, q: HeadSource | None, k: HeadSource | None) -> None:
        notes = [s.reason for s in (q, k) if s is not None and s.reason]
        if q is None or k is None or q.projection is None or k.projection is None:
            amap.qk_note = "; ".join(notes) or "q/k could not be followed to a projection"
            return
        amap.qk_norm = q.normed_by or k.normed_by
        q_mod, k_mod = self.module_output_of(q.projection), self.module_output_of(k.projection)
        if not (q.plain and k.plain):
            amap.qk_note = "; ".join(notes)
            amap.qk_mixed = True
        elif q_mod is None or k_mod is None:  # projection ops inside a forward: known by their weights
            amap.q_weight, amap.q_site = q.projection.param, q.projection.module
            amap.k_weight, amap.k_site = k.projection.param, k.projection.module
            amap.q_weight_axis, amap.k_weight_axis = q.projection.axis, k.projection.axis
        if q_mod is not None and q_mod == k_mod and q.projection.index == k.projection.index:
            amap.qkv = q_mod
            amap.qkv_layout = _layout(q.columns, k.columns)
        else:
            amap.q, amap.k = q_mod, k_mod
        amap.q_columns, amap.k_columns = q.columns, k.columns

    def _parts(self, amap: AttentionMap, call: AttentionCall, q: HeadSource, k: HeadSource) -> None:
        """q and k by part when either is made from several projections (MLA); nothing when a part
        cannot be told (`stabkit.discovery.trace_heads.head_parts`)."""
        q_parts = q.parts or self._single_parts(call.q, q)
        k_parts = k.parts or self._single_parts(call.k, k)
        if not q_parts or not k_parts:
            return
        amap.k_parts = [self._part(p, p.dims, list(range(len(p.dims))), p.shared) for p in k_parts]
        pieces: list[QKPart] = []
        for qp in q_parts:
            for kp in k_parts:
                keep = [i for i, d in enumerate(qp.dims) if d in set(kp.dims)]
                if keep:
                    pieces.append(self._part(qp, [qp.dims[i] for i in keep], keep, False))
        amap.q_parts = pieces

    def _single_parts(self, x: Any, source: HeadSource) -> list[HeadPart] | None:
        """The one part of a plain single-projection source (its head-dim positions read as in
        `head_parts`)."""
        if x is None or source.projection is None or not source.plain:
            return None
        noise = torch.ones(x.shape[1], x.shape[3], device=x.device, dtype=x.dtype)
        return head_parts(x, [source.projection], noise)

    def _part(self, part: HeadPart, dims: list[int], keep: list[int], shared: bool) -> QKPart:
        proj = part.projection
        module = self.module_output_of(proj)
        columns = [[cols[i] for i in keep] for cols in part.columns]
        if module is not None:
            return QKPart(module, dims, columns, shared=shared)
        return QKPart(proj.param, dims, columns, weight=True, axis=proj.axis, shared=shared)

    def _out_projection(self, call: AttentionCall, scope: str, block: str) -> str | None:
        """The first projection after the call inside the attention scope (or the block, inline)."""
        inside = scope if scope != block else block
        for proj in self.trace.projections:
            if proj.index > call.index and _under(proj.module, inside):
                return self.module_output_of(proj)
        return None

    # ------------------------------------------------------------------ mlp
    def mlp(self, block: str, scopes: list[str], after: int) -> tuple[str | None, list[Projection]]:
        """The MLP module of the block and its projections (those after the attention, outside it)."""
        start, end, _ = self.window(block)
        attn_owners = {
            p
            for s in scopes
            for p in _lineage(s)
            if _under(p, block)
            and p != block
            and not isinstance(self.modules[p], nn.ModuleList | nn.ModuleDict)
        }
        projs = [
            p
            for p in self.trace.projections
            if start <= p.index < end
            and p.index > after
            and _under(p.module, block)
            and not any(_under(p.module, o) for o in attn_owners)
        ]
        named = child(self.modules[block], ("mlp", "ffn", "feed_forward", "ff", "mlp_block", "feedforward"))
        if named is not None:
            path = f"{block}.{named}" if block else named
            if not any(_under(s, path) for s in scopes):
                return path, projs or [p for p in self.trace.projections if _under(p.module, path)]
        if not projs:
            return None, []
        path = _common_module([p.module for p in projs])
        if path and path != block and _under(path, block) and not any(_under(s, path) for s in scopes):
            return path, projs
        return None, projs

    # ------------------------------------------------------------------ norms
    def norms(
        self, block: str, subs: list[tuple[str, int | None, int | None, int, int]], scopes: list[str]
    ) -> tuple[list[NormMap], str]:
        """Classify the block's norms against its sub-layers ``(name, in, out, start, end)``; norms
        inside an attention module (its own QK-norm) are not block norms."""
        start, end, call = self.window(block)
        t = self.trace
        block_out = call.output if call is not None else _last_node(t, start, end)
        norm_calls = [
            m
            for m in t.modules
            if start <= m.start
            and m.end <= end
            and _under(m.path, block)
            and m.path != block
            and is_norm(self.modules[m.path])
            and m.input is not None
            and m.output is not None
            and not any(_under(m.path, sc) for sc in scopes if sc != block)
        ]
        taken: dict[str, NormMap] = {}
        positions: dict[str, set[str]] = {name: set() for name, *_ in subs}
        for name, _s_in, s_out, _s0, s_end in subs:
            after = [n for n in norm_calls if n.start >= s_end and n.path not in taken]
            first = next((n for n in after if self.derives(n.input, s_out, start)), None)
            if first is None or block_out is None:
                continue
            bypass = first.input in t.ancestors(block_out, start, frozenset({first.output or -1}))
            if bypass:
                continue
            position = "post" if self.residual_between(s_out, first.input, start) else "sandwich"
            taken[first.path] = NormMap(first.path, norm_kind(self.modules[first.path]), name, position)
            positions[name].add(position)
        for name, s_in, _s_out, s_start, _e in subs:
            free = [
                n for n in norm_calls if n.end <= s_start + 1 and taken.get(n.path, _PRE).position == "pre"
            ]
            guard = next((n for n in reversed(free) if self.derives(s_in, n.output, start)), None)
            if guard is not None:  # a norm feeding two sub-layers (parallel blocks) keeps its first
                taken.setdefault(
                    guard.path, NormMap(guard.path, norm_kind(self.modules[guard.path]), name, "pre")
                )
                positions[name].add("pre")
        for n in norm_calls:  # a norm shared by two sub-layers (parallel blocks) is listed once
            if n.path not in taken:
                taken[n.path] = NormMap(n.path, norm_kind(self.modules[n.path]), "unknown", "unknown")
        order = {m.path: m.start for m in norm_calls}
        norms = sorted(taken.values(), key=lambda nm: order.get(nm.path, 0))
        return norms, _placement([positions[name] for name, *_ in subs])

    def residual_between(
        self, source: int | None, target: int | None, since: int, before: int | None = None
    ) -> bool:
        """True when the way from `source` to `target` passes an add whose other operand is not
        computed from `source` and has the sum's shape (a residual connection); with `before`, that
        operand must also come from outside (made before op `before`): a MoE adding its routed and
        shared experts' outputs is no residual."""
        t = self.trace
        if source is None or target is None:
            return False
        for node in t.ancestors(target, since):
            if (
                node == source
                or not is_add(t.op_name.get(node, ""))
                or source not in t.ancestors(node, since)
            ):
                continue
            for p in t.parents.get(node, ()):
                if source in t.ancestors(p, since) or t.shapes.get(p) != t.shapes.get(node):
                    continue
                if before is None or t.created.get(p, -1) < before:
                    return True
        return False


def _common_module(paths: list[str]) -> str:
    """The deepest module path containing every path in `paths`."""
    parts = [p.split(".") for p in paths]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def _last_node(trace: Trace, start: int, end: int) -> int | None:
    best, best_index = None, -1
    for node, index in trace.created.items():
        if start <= index < end and index > best_index:
            best, best_index = node, index
    return best


def _placement(per_sublayer: Iterable[set[str]]) -> str:
    kinds = set()
    for positions in per_sublayer:
        if positions == {"pre", "sandwich"}:
            kinds.add("sandwich")
        elif positions == {"pre"}:
            kinds.add("pre")
        elif positions == {"post"} or positions == {"pre", "post"}:
            kinds.add("post")
        elif positions == {"sandwich"}:
            kinds.add("output")
        else:
            kinds.add("unknown")
    return kinds.pop() if len(kinds) == 1 else "unknown"


def _layout(q_cols: list[list[int]], k_cols: list[list[int]]) -> str:
    flat_q = [c for h in q_cols for c in h]
    width = len(flat_q)
    if flat_q == list(range(width)) and [c for h in k_cols for c in h][:1] == [width]:
        return "q|k|v"
    return "traced"
