"""Find the mixture-of-experts layers of a model in its traced forward, by what the model does.

Runs once at discovery time (`stabkit.discovery.trace_map.map_from_trace`), never per step. A router
is a ``topk`` whose indices the model goes on to use, taken over the last dimension of E values made
from one projection with E outputs (the gate) — directly (GPT-OSS, GraniteMoE, Llama 4), through a
softmax (Mixtral, Qwen-MoE, OLMoE, Jamba) or a sigmoid plus a bias of shape (E,) (DeepSeek-V3). From
there:

- the *router* is the innermost module whose forward ran both the gate and the top-k;
- the *layer* is the innermost module holding the router whose output is made from the choice (the
  router itself when it also runs the experts);
- the *experts* are the module(s) inside the layer, outside the router, whose output is made from the
  choice; *shared experts* are the layer's other children holding two or more projections whose
  output is not;
- the router logits and the chosen indices are read from the router's output when it returns them
  (which item of its tuple); else the logits from the gate module and the indices recomputed;
- a *score bias* is a parameter or buffer of shape (E,) added between the gate and the top-k; the
  choice is *grouped* when another ``topk`` between them picks groups of experts (DeepSeek-V3).

No class or module name is read. A router this cannot see (a fused top-k kernel) can be registered
(`stabkit.moe.registry.register_router`).
"""

from __future__ import annotations

from ..discovery.trace import ModuleCall, Projection, Selection, is_add
from ..discovery.trace_builder import TraceBuilder, _common_module, _under
from .map import MoEMap, Scoring, Where

SOFTMAX_OPS = {"softmax", "log_softmax", "_softmax"}
SIGMOID_OPS = {"sigmoid", "sigmoid_"}


def find_moe(b: TraceBuilder) -> list[MoEMap]:
    """Every MoE layer the trace shows (one per router module, in the order they ran)."""
    t = b.trace
    used = {p for parents in t.parents.values() for p in parents}
    named = {id(x): n for n, x in [*b.model.named_parameters(), *b.model.named_buffers()]}
    found: dict[str, MoEMap] = {}
    for sel in t.selections:
        n = t.shapes.get(sel.input, ())[-1:]
        k = t.shapes.get(sel.indices, ())[-1:]
        if not n or not k or not 1 <= k[0] < n[0] or sel.indices not in used:
            continue
        gate = _gate(b, sel, n[0])
        if gate is None:
            continue
        router = _innermost(b, gate.index, sel.index)
        if router is None or router.path in found:
            continue
        moe = _layer(b, sel, gate, router, n[0], k[0], named)
        if moe is not None:
            found[router.path] = moe
    return list(found.values())


def _gate(b: TraceBuilder, sel: Selection, n: int) -> Projection | None:
    """The latest projection with `n` output features that the selected scores are made from."""
    t = b.trace
    for proj in reversed([p for p in t.projections if p.index < sel.index]):
        if t.shapes.get(proj.output, ())[-1:] != (n,):
            continue
        if proj.output in t.ancestors(sel.input, proj.index):
            return proj
    return None


def _innermost(b: TraceBuilder, first: int, last: int) -> ModuleCall | None:
    """The innermost module call whose forward ran ops `first` to `last`."""
    spans = [m for m in b.trace.modules if m.start <= first and last < m.end]
    return max(spans, key=lambda m: m.start) if spans else None


def _scoring(b: TraceBuilder, sel: Selection, gate: Projection) -> Scoring:
    names = {b.trace.op_name.get(x, "") for x in b.trace.ancestors(sel.input, gate.index)}
    if names & SOFTMAX_OPS:
        return "softmax"
    if names & SIGMOID_OPS:
        return "sigmoid"
    return "logits"


def _score_bias(
    b: TraceBuilder, sel: Selection, gate: Projection, n: int, named: dict[int, str]
) -> str | None:
    """A named (E,) parameter or buffer added between the gate and the top-k."""
    t = b.trace
    for node in t.ancestors(sel.input, gate.index):
        if not is_add(t.op_name.get(node, "")):
            continue
        for p in t.parents.get(node, ()):
            if p in named and t.shapes.get(p) == (n,):
                return named[p]
    return None


def _derived_from(b: TraceBuilder, node: int | None, sources: set[int], since: int) -> bool:
    return node is not None and bool(sources & b.trace.ancestors(node, since))


def _descendants(b: TraceBuilder, sources: set[int]) -> set[int]:
    """Every tensor computed from `sources` (forward through the traced ops)."""
    children: dict[int, set[int]] = {}
    for node, parents in b.trace.parents.items():
        for p in parents:
            children.setdefault(p, set()).add(node)
    seen, todo = set(sources), list(sources)
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in seen:
                seen.add(c)
                todo.append(c)
    return seen


def _reads(b: TraceBuilder, call: ModuleCall, reached: set[int]) -> bool:
    """True when an op inside `call` takes a tensor computed from the choice, made before the call
    returned (the experts do; a shared expert whose output the layer then adds the routed output
    into, in place, does not)."""
    t = b.trace
    for node in reached:
        index = t.created.get(node, -1)
        if call.start <= index < call.end and any(
            t.created.get(p, -1) < call.end for p in t.parents.get(node, ()) if p in reached
        ):
            return True
    return False


def _layer(
    b: TraceBuilder,
    sel: Selection,
    gate: Projection,
    router: ModuleCall,
    n: int,
    k: int,
    named: dict[int, str],
) -> MoEMap | None:
    t = b.trace
    choice = {sel.values, sel.indices}
    outer = sorted(
        (m for m in t.modules if m.start <= router.start and router.end <= m.end), key=lambda m: -m.start
    )  # the router's call and its ancestors, innermost first
    after = [p for p in t.projections if router.start <= p.index < router.end and p.index > sel.index]
    layer = router if after else None
    if layer is None:
        layer = next(
            (m for m in outer if m is not router and _derived_from(b, m.output, choice, router.start)), None
        )
    if layer is None:
        return None
    inside = [
        m
        for m in t.modules
        if layer.start <= m.start
        and m.end <= layer.end
        and m is not layer
        and not _under(router.path, m.path)
        and not _under(m.path, router.path)
    ]
    reached = _descendants(b, choice)
    experts_calls = [m for m in inside if _reads(b, m, reached)]
    experts = _common_module([m.path for m in experts_calls]) if experts_calls else None
    if experts is not None and not _under(experts, layer.path):
        experts = None
    depth = layer.path.count(".") + 1 if layer.path else 0
    shared = [
        m.path
        for m in inside
        if m.path.count(".") == depth
        and m not in experts_calls
        and not (experts and _under(m.path, experts))
        and sum(1 for p in t.projections if m.start <= p.index < m.end) >= 2
    ]
    module_gate = b.module_output_of(gate)
    moe = MoEMap(
        path=layer.path,
        router=router.path,
        n_experts=n,
        top_k=k,
        gate_weight=gate.param if gate.param != "?" else None,
        gate=module_gate,
        scoring=_scoring(b, sel, gate),
        score_bias=_score_bias(b, sel, gate, n, named),
        grouped=any(s is not sel and gate.index < s.index < sel.index for s in t.selections),
        experts=experts,
        shared_experts=list(dict.fromkeys(shared)),
    )
    moe.logits, moe.indices = _outputs(b, router, gate, sel, module_gate, layer is router)
    return moe


def _outputs(
    b: TraceBuilder,
    router: ModuleCall,
    gate: Projection,
    sel: Selection,
    module_gate: str | None,
    inline: bool,
) -> tuple[Where | None, Where | None]:
    """Where the logits and the indices are read: items of the router's output when it returns them,
    else the gate module's output (and the indices recomputed)."""
    logits: Where | None = None
    indices: Where | None = None
    t = b.trace
    shape = t.shapes.get(gate.output)
    if not inline:
        for i, x in enumerate(router.outputs):
            if x is None:
                continue
            if x == sel.indices and indices is None:
                indices = Where(router.path, i)
            elif logits is None and t.shapes.get(x) == shape and b._chain(gate.output, x, gate.index):
                logits = Where(router.path, i)
        if router.output == gate.output and not router.outputs:
            logits = Where(router.path, None)
    if logits is None and module_gate is not None and module_gate != router.path:
        logits = Where(module_gate, None)
    if logits is None and module_gate == router.path and not router.outputs:
        logits = Where(router.path, None)
    return logits, indices
