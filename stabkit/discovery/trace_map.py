"""Build a ModelMap from a traced forward: blocks, attention call sites, heads, q/k rows, MLP, norm
placement and the final logits, all from what the model did (see `stabkit.discovery.trace`).

Runs once at discovery time. Names are used only where the trace cannot tell (which child is the
value projection) and to label the family.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from ..moe.find import find_moe
from .families import family_of
from .families import mlp_path as mlp_path_by_name
from .modelmap import AttentionMap, BlockMap, ModelMap
from .trace import AttentionCall, Trace
from .trace_builder import TraceBuilder, _lineage, _parent, _under
from .trace_logits import find_final_logits
from .trace_units import gaps, other_blocks, parallel_mixer, repeated_units

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


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


def map_from_trace(model: nn.Module, trace: Trace) -> ModelMap:
    """Turn a trace into a ModelMap (see the module docstring). Raises DiscoveryError when the traced
    forward made no attention call stabkit recognises."""
    b = TraceBuilder(model, trace)
    if not trace.calls:
        units = repeated_units(b)
        for index, bm in enumerate(units):
            bm.index = index
        mmap = ModelMap(family="traced", blocks=units)
        mmap.found = {"blocks": "repeated units" if units else "none", "attention": "none"}
        _find_moe(b, mmap)
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
    _find_moe(b, mmap)
    find_final_logits(b, mmap)
    mmap.gaps = gaps(b, mmap)
    return mmap


def _find_moe(b: TraceBuilder, mmap: ModelMap) -> None:
    """The MoE layers (`stabkit.moe.find`), and the routers users registered."""
    from ..moe.registry import registered_routers

    mmap.moe = find_moe(b)
    mmap.moe += registered_routers(b, {m.router for m in mmap.moe})
    if mmap.moe:
        mmap.found["moe"] = "traced"


def _child_of(path: str, block: str) -> str:
    """The direct child of `block` that `path` is under (`path` itself when it is one)."""
    rest = path[len(block) + 1 :] if block else path
    return rest.split(".")[0]


def _lift_scope(b: TraceBuilder, call: AttentionCall) -> None:
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


def _block(b: TraceBuilder, index: int, path: str, calls: list[AttentionCall]) -> BlockMap:
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


def _output_before_residual(b: TraceBuilder, a: AttentionMap, call: AttentionCall | None, since: int) -> None:
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


def _scope_end(b: TraceBuilder, scope: str, call_index: int, block: str) -> int:
    if scope == block:
        return call_index
    for m in b.trace.modules:
        if m.path == scope and m.start <= call_index < m.end:
            return m.end
    return call_index


def _sublayer_of_attention(
    b: TraceBuilder, call: AttentionCall, scope: str, block: str
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
