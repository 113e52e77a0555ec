"""Build a ModelMap from a traced forward: blocks, attention call sites, heads, q/k rows, MLP, norm
placement and the final logits, all from what the model did (see `stabkit.discovery.trace`).

Runs once at discovery time. Names are used only where the trace cannot tell (which child is the
value projection) and to label the family.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from torch import nn

from .families import family_of
from .families import mlp_path as mlp_path_by_name
from .modelmap import AttentionMap, BlockMap, ModelMap, NormMap
from .roles import OUT_NAMES, V_NAMES, child, is_norm, map_attention, norm_kind
from .trace import AttentionCall, ModuleCall, Projection, Trace, is_add
from .trace_heads import HeadSource, head_source
from .trace_logits import find_final_logits
from .trace_units import gaps, other_blocks, parallel_mixer, repeated_units

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)
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


def block_of_scope(scope: str, scopes: set[str], modules: dict[str, nn.Module]) -> str:
    """The repeated unit holding an attention call site: the innermost ancestor (or the scope itself)
    held by a container (ModuleList, Sequential, ModuleDict) next to a sibling of the same class that
    also holds attention calls; else such an ancestor under any parent (but not a call site beside
    another: BART's self- and cross-attention share a class); else the innermost one held by a
    container; else the scope."""

    def repeated(path: str) -> bool:
        parent_path = _parent(path)
        mine = modules[path]
        for name, sibling in modules[parent_path].named_children():
            full = f"{parent_path}.{name}" if parent_path else name
            if full != path and type(sibling) is type(mine) and any(_under(s, full) for s in scopes):
                return True
        return False

    lineage = _lineage(scope)
    for path in lineage:
        if isinstance(modules[_parent(path)], CONTAINERS) and repeated(path):
            return path
    for path in lineage:
        if path not in scopes and repeated(path):
            return path
    for path in lineage:
        if isinstance(modules[_parent(path)], CONTAINERS):
            return path
    return scope


class _Builder:
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
        if q_mod is not None and q_mod == k_mod and q.projection.index == k.projection.index:
            amap.qkv = q_mod
            amap.qkv_layout = _layout(q.columns, k.columns)
        else:
            amap.q, amap.k = q_mod, k_mod
        amap.q_columns, amap.k_columns = q.columns, k.columns

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


def map_from_trace(model: nn.Module, trace: Trace) -> ModelMap:
    """Turn a trace into a ModelMap (see the module docstring). Raises DiscoveryError when the traced
    forward made no attention call stabkit recognises."""
    b = _Builder(model, trace)
    if not trace.calls:
        units = repeated_units(b)
        for index, bm in enumerate(units):
            bm.index = index
        mmap = ModelMap(family="traced", blocks=units)
        mmap.found = {"blocks": "repeated units" if units else "none", "attention": "none"}
        find_final_logits(b, mmap)
        mmap.gaps = gaps(b, mmap)
        return mmap
    for call in trace.calls:
        _lift_scope(b, call)
    scopes = {c.scope for c in trace.calls}
    first_choice = {sc: block_of_scope(sc, scopes, b.modules) for sc in scopes}
    common = Counter(type(b.modules[p]) for p in first_choice.values()).most_common(1)[0][0]
    by_block: dict[str, list[AttentionCall]] = {}
    for call in trace.calls:
        # nested stages of different depth (Swin): prefer the ancestor of the class most blocks have
        same = [p for p in _lineage(call.scope) if type(b.modules[p]) is common]
        block = same[0] if same else first_choice[call.scope]
        by_block.setdefault(block, []).append(call)
    blocks: list[BlockMap] = [_block(b, 0, path, calls) for path, calls in by_block.items()]
    blocks += other_blocks(b, blocks)
    first_run = {m.path: i for i, m in reversed(list(enumerate(trace.modules)))}
    blocks.sort(key=lambda bm: first_run.get(bm.path, len(trace.modules)))
    for index, bm in enumerate(blocks):
        bm.index = index
    mmap = ModelMap(family="traced", blocks=blocks)
    mmap.found = {"blocks": "traced", "attention": "traced", "heads": "traced", "placement": "traced"}
    find_final_logits(b, mmap)
    mmap.gaps = gaps(b, mmap)
    return mmap


def _child_of(path: str, block: str) -> str:
    """The direct child of `block` that `path` is under (`path` itself when it is one)."""
    rest = path[len(block) + 1 :] if block else path
    return rest.split(".")[0]


def _lift_scope(b: _Builder, call: AttentionCall) -> None:
    """The attention module of a call is the innermost running module that also holds its q and k
    projections: a call made by a child without them (an ``sdpa`` wrapper module, Transformer
    Engine's ``DotProductAttention``) belongs to the parent that projects q and k."""
    if call.q is None or call.k is None or not call.stack:
        return
    sources = [b.source(call, w) for w in ("q", "k")]
    found = [b.module_output_of(s.projection) for s in sources if s is not None and s.projection is not None]
    owners = [o for o in found if o is not None]
    if not owners:
        return
    for depth in range(len(call.stack) - 1, -1, -1):
        path = call.stack[depth]
        if all(_under(o, path) for o in owners):
            if depth < len(call.stack) - 1 and b.modules[path] is not b.model:
                call.stack = call.stack[: depth + 1]
            return


def _block(b: _Builder, index: int, path: str, calls: list[AttentionCall]) -> BlockMap:
    seen: dict[str, AttentionMap] = {}
    first_call: dict[str, AttentionCall] = {}
    for call in calls:
        if call.scope not in seen:
            seen[call.scope] = b.attention_map(call, path)
            first_call[call.scope] = call
    attns = sorted(seen.values(), key=lambda a: a.cross)
    scopes = list(seen)
    last_attn_end = max(_scope_end(b, c.scope, c.index, path) for c in calls)
    mlp_path, mlp_projs = b.mlp(path, scopes, last_attn_end)
    if mlp_path is None:  # e.g. nn.TransformerEncoderLayer: linear1/linear2 are the block's own children
        block_module = b.modules[path]
        rel = mlp_path_by_name(family_of(block_module), block_module)
        if rel is not None and not any(_under(sc, f"{path}.{rel}") for sc in scopes):
            mlp_path = f"{path}.{rel}" if path else rel
    start, _, _ = b.window(path)
    if mlp_projs:
        last = b.module_output_of(mlp_projs[-1])
        m_call = next((m for m in b.trace.modules if m.path == mlp_path), None) if mlp_path else None
        inside = m_call is not None and b.residual_between(
            mlp_projs[-1].output, m_call.output, start, before=m_call.start
        )
        branches = {_child_of(p.module, path) for p in mlp_projs}
        chained = b.derives(mlp_projs[-1].input, mlp_projs[0].output, start)  # fc1 -> fc2 (Whisper)
        if mlp_path is None and len(branches) > 1 and not chained:  # a sum of siblings (MoE + shared MLP)
            last = None
        if last is not None and (mlp_path is None or inside):
            mlp_path = (
                last  # the MLP's output is its last projection's (fc2; Bloom adds the residual after it)
            )
    for a in attns:
        _output_before_residual(b, a, first_call.get(a.path), start)
    subs: list[tuple[str, int | None, int | None, int, int]] = []
    attn_in: int | None = None
    attn_out: int | None = None
    for scope, call in first_call.items():
        s_in, s_out, s0, s1 = _sublayer_of_attention(b, call, scope, path)
        if attn_in is None:
            attn_in, attn_out = s_in, s_out
        subs.append(("attn", s_in, s_out, s0, s1))
    parallel = False
    if mlp_projs:
        m_in = mlp_projs[0].input
        m_call = next((m for m in b.trace.modules if m.path == mlp_path), None) if mlp_path else None
        m_out = m_call.output if m_call is not None else mlp_projs[-1].output
        m_start = m_call.start if m_call is not None else mlp_projs[0].index
        m_end = m_call.end if m_call is not None else mlp_projs[-1].index + 1
        subs.append(("mlp", m_in, m_out, m_start, m_end))
        start, _, _ = b.window(path)
        parallel = attn_out is not None and not b.derives(m_in, attn_out, start)
    norms, placement = b.norms(path, subs, scopes)
    mixer = parallel_mixer(b, path, [*scopes, *(a.path for a in attns), mlp_path])
    return BlockMap(
        index=index,
        path=path,
        attention=attns[0],
        mlp=mlp_path,
        norms=norms,
        placement=placement,  # type: ignore[arg-type]
        attentions=attns,
        parallel=parallel,
        mixer=mixer,
    )


def _output_before_residual(b: _Builder, a: AttentionMap, call: AttentionCall | None, since: int) -> None:
    """Set `a.output` when the attention module adds the residual itself (its output is not the
    sub-layer's): then the sub-layer output is its output projection's."""
    if call is None or a.path == "" or a.out is None:
        return
    record = next((m for m in b.trace.modules if m.path == a.path and m.start <= call.index < m.end), None)
    out_proj = next(
        (p for p in b.trace.projections if p.index > call.index and _under(p.module, a.path)), None
    )
    if record is None or out_proj is None:
        return
    if b.residual_between(out_proj.output, record.output, since):
        a.output = a.out


def _scope_end(b: _Builder, scope: str, call_index: int, block: str) -> int:
    if scope == block:
        return call_index
    for m in b.trace.modules:
        if m.path == scope and m.start <= call_index < m.end:
            return m.end
    return call_index


def _sublayer_of_attention(
    b: _Builder, call: AttentionCall, scope: str, block: str
) -> tuple[int | None, int | None, int, int]:
    """(input id, output id, first op, last op) of the attention sub-layer of one call site."""
    q_src = b.source(call, "q") if call.q is not None else None
    s_in = q_src.projection.input if q_src is not None and q_src.projection is not None else None
    if call.kind == "torch_mha":
        s_in = call.query_input
    record = next((m for m in b.trace.modules if m.path == scope and m.start <= call.index < m.end), None)
    if scope != block and record is not None:
        return s_in if s_in is not None else record.input, record.output, record.start, record.end
    return s_in, call.output, call.index, call.index + 1
