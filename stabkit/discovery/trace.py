"""Watch one forward pass and record what the model *does*: module calls, projections, attention
calls, and which tensor was computed from which.

Runs once, at discovery time (`stabkit.inspect_model`, `attach`), never per step. While the traced forward
runs, a `torch.overrides.TorchFunctionMode` sees every torch function and global module hooks keep
the stack of running modules. What it records:

- every op as a node of a small data-flow graph (tensor ids; every tensor is kept alive until the
  trace is dropped, so ids stay unique);
- *projections*: a linear-like op (``F.linear``, ``addmm``, ``matmul``/``@``, ``mm``, ``bmm``,
  ``einsum``) with exactly one operand that is a model parameter (or computed from parameters only,
  e.g. ``wte.weight.T``). Its output is handed back to the model as a fresh autograd leaf (same
  values), so the graph from one projection to whatever it feeds is short and can be differentiated
  even for frozen models or under ``no_grad``;
- *attention calls*: ``F.scaled_dot_product_attention``, ``F.multi_head_attention_forward``, the
  calls of known attention kernels (`stabkit.attention.kernels`: flash-attn, FlexAttention, xformers,
  Transformer Engine, registered ones; q and k in (B, H, L, E) views), and a softmax over the last
  dim of a 4-d tensor computed from a product of two activations (eager ``softmax(q kᵀ · scale +
  mask)``, also when the model subtracts the row max or appends sink columns first), each with the
  running module stack and its q and k;
- *opaque ops*: other non-aten torch ops taking two or more (…, ≥ 3-d) float tensors — the custom
  kernels a model may compute attention in — so that a gap can be named.

The traced forward must leave the model as it was: `run_trace` restores the RNG streams and every
buffer afterwards, and the values the model computes are the same as without the trace.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..attention import kernels
from ..attention.scope import SDPA, SOFTMAXES

LINEAR: dict[Callable[..., Any], str] = {
    F.linear: "linear",
    torch.addmm: "addmm",
    torch.Tensor.addmm: "addmm",
    torch.matmul: "matmul",
    torch.Tensor.matmul: "matmul",
    torch.Tensor.__matmul__: "matmul",
    torch.mm: "matmul",
    torch.Tensor.mm: "matmul",
    torch.bmm: "matmul",
    torch.Tensor.bmm: "matmul",
    torch.baddbmm: "baddbmm",
    torch.Tensor.baddbmm: "baddbmm",
    torch.einsum: "einsum",
}
"""Linear-like torch functions: a projection when one operand is a parameter (or made from one)."""
_RMATMUL = torch.Tensor.__rmatmul__
_MIXING = {
    F.conv1d,
    F.conv2d,
    torch.conv1d,
    torch.cumsum,
    torch.Tensor.cumsum,
    torch.cumprod,
    torch.Tensor.cumprod,
}

_TOPK = {torch.topk, torch.Tensor.topk}


_TRACING = [0]


def tracing() -> bool:
    """True while discovery's traced forward runs: stabkit's own monitoring hooks ignore that pass."""
    return _TRACING[0] > 0


@contextmanager
def _tracing() -> Iterator[None]:
    _TRACING[0] += 1
    try:
        yield
    finally:
        _TRACING[0] -= 1


@dataclass
class Projection:
    """A linear-like op with one parameter operand (q_proj, a fused qkv, an MLP matrix, the head)."""

    index: int
    """Op index in the trace."""
    param: str
    """Name of the parameter operand (e.g. ``blocks.0.attn.qkv.weight``)."""
    module: str
    """Innermost module running when the op ran ('' = the root)."""
    input: int
    """Id of the activation operand."""
    output: int
    """Id of the tensor handed back to the model."""
    leaf: torch.Tensor
    """Autograd leaf holding the op's output values (the model got a clone of it)."""
    axis: int | None = None
    """The axis of the parameter that indexes the op's output features (``F.linear``: 0; ``x @ W``,
    HF Conv1D's ``addmm``: the last; an einsum: the axis of the output's last index), when the
    operand is the parameter itself; None when it is made from it (``W.T``) or cannot be told."""


@dataclass
class AttentionCall:
    """One attention call seen in the traced forward."""

    index: int
    kind: str
    """'sdpa', 'eager' or 'torch_mha'."""
    stack: tuple[str, ...]
    """Paths of the running modules, outermost first ('' = root)."""
    q: torch.Tensor | None
    """(B, H, L, E) queries as the call sees them (None for torch_mha)."""
    k: torch.Tensor | None
    """(B, Hkv, S, E) keys as the call sees them."""
    output: int | None
    """Id of the call's output (SDPA/MHA: attention output; eager: the softmax weights)."""
    query_input: int | None = None
    """torch_mha only: ids of the query and key arguments."""
    key_input: int | None = None
    shifted: bool = False
    """eager only: the softmax input is the logits minus their row max."""
    sink_columns: int = 0
    """eager only: columns the softmax input has beyond the keys (learned sinks)."""
    note: str = ""
    """kernel calls whose q and k could not be read: why."""

    @property
    def scope(self) -> str:
        """Innermost module whose forward made the call."""
        return self.stack[-1] if self.stack else ""


@dataclass
class ModuleCall:
    """One module forward in the traced pass."""

    path: str
    start: int
    """Op index when it was entered."""
    end: int = -1
    """Op index when it returned."""
    input: int | None = None
    """Id of its first tensor argument."""
    output: int | None = None
    """Id of the first tensor of its output."""
    outputs: tuple[int | None, ...] = ()
    """Ids of the items of a tuple/list output (None for an item that is not a tensor): where a
    router returns its logits, scores and chosen experts (`stabkit.moe.find`)."""


@dataclass
class Selection:
    """A ``topk`` op in the traced forward (how a MoE router picks its experts)."""

    index: int
    """Op index in the trace."""
    input: int
    """Id of the tensor it selects from."""
    values: int
    """Id of the selected values."""
    indices: int
    """Id of the selected indices."""


@dataclass
class Trace:
    """What one traced forward did (see the module docstring)."""

    parents: dict[int, set[int]] = field(default_factory=dict)
    """Tensor id -> ids of the tensors it was computed from."""
    op_name: dict[int, str] = field(default_factory=dict)
    """Tensor id -> name of the op that produced it."""
    created: dict[int, int] = field(default_factory=dict)
    """Tensor id -> op index that produced it."""
    ops: int = 0
    projections: list[Projection] = field(default_factory=list)
    calls: list[AttentionCall] = field(default_factory=list)
    modules: list[ModuleCall] = field(default_factory=list)
    output: Any = None
    """The model's output."""
    shapes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    """Tensor id -> shape."""
    keep: list[Any] = field(default_factory=list)
    """Strong references to every tensor seen, so no id is reused while the trace lives."""
    mixing: list[int] = field(default_factory=list)
    """Op indices of token-mixing ops (a product of two activations, a convolution, a cumulative
    sum): how a layer without attention (Mamba, linear attention, a convolution) is told from an MLP."""
    opaque_ops: list[tuple[str, tuple[str, ...]]] = field(default_factory=list)
    selections: list[Selection] = field(default_factory=list)
    """Every ``topk`` op (candidate MoE expert choices)."""
    param_like: set[int] = field(default_factory=set)
    """Ids of parameters and of tensors computed from parameters only (``w.T``, a bias slice)."""
    """(op name, module stack) of custom ops that may be attention kernels stabkit does not know."""
    device_type: str = "cpu"

    def ancestors(self, node: int, since: int = 0, blocked: frozenset[int] = frozenset()) -> set[int]:
        """Ids `node` was computed from (itself included), following ops produced at index >= `since`
        and not expanding through `blocked` nodes."""
        seen = {node}
        todo = [node]
        while todo:
            n = todo.pop()
            if n in blocked or self.created.get(n, -1) < since:
                continue
            for p in self.parents.get(n, ()):
                if p not in seen:
                    seen.add(p)
                    todo.append(p)
        return seen

    def calls_of(self, prefix: str) -> list[ModuleCall]:
        """Module calls at or under `prefix` (every call for '')."""
        return [m for m in self.modules if _under(m.path, prefix)]


def _under(path: str, prefix: str) -> bool:
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """Tensors in a value, a (nested, one level) tuple/list, or a dict."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, list | tuple):
        for v in value:
            if isinstance(v, torch.Tensor):
                yield v
            elif isinstance(v, list | tuple):
                yield from (x for x in v if isinstance(x, torch.Tensor))
    elif isinstance(value, dict):
        yield from (v for v in value.values() if isinstance(v, torch.Tensor))


def _layout(x: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors the same values: storage, offset, shape, strides, dtype (of a DTensor:
    its local piece's, which holds the storage)."""
    inner = getattr(x, "_local_tensor", None)
    base = inner if isinstance(inner, torch.Tensor) else x
    return (base.untyped_storage().data_ptr(), base.storage_offset(), tuple(x.shape), base.stride(), x.dtype)


def first_tensor_in(value: Any) -> torch.Tensor | None:
    """The main tensor of a module's output or arguments: the tensor itself, the first tensor item of
    a tuple/list, or the first tensor value of a dict / HF ModelOutput; None when there is none.
    (The probes measure the same tensor: `stabkit.probes.first_tensor`.)"""
    if isinstance(value, torch.Tensor):
        return value
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else ()
    return next((v for v in items if isinstance(v, torch.Tensor)), None)


def _weight_axis(kind: str, args: tuple[Any, ...], weight: torch.Tensor, first: bool) -> int | None:
    """The axis of projection operand `weight` (a parameter) that indexes the output features;
    `first`: the weight is the first operand. None when it cannot be told."""
    if kind == "linear":
        return 0 if weight.dim() == 2 else None
    if kind == "einsum":
        m = _EINSUM_TERM.match(str(args[0]).replace(" ", ""))
        if m is None:
            return None
        lhs, rhs, res = m.groups()
        term = lhs if first else rhs
        return (
            term.index(res[-1])
            if res and res[-1] in term and res[-1] not in (rhs if first else lhs)
            else None
        )
    if first or weight.dim() < 2:
        return None
    return weight.dim() - 1  # x @ W, addmm(bias, x, W), baddbmm: W's last axis


_EINSUM_TERM = re.compile(r"^\s*([\w.]+)\s*,\s*([\w.]+)\s*->\s*([\w.]+)\s*$")


class _Recorder(TorchFunctionMode):
    """The function mode of a trace (see the module docstring)."""

    def __init__(self, trace: Trace, params: dict[int, str], stack: list[str]) -> None:
        super().__init__()
        self.trace = trace
        self.param_names = params
        self.param_like: set[int] = set(params)
        self.products: dict[int, tuple[torch.Tensor, torch.Tensor, tuple[str, ...]]] = {}
        """id of a q·kᵀ-like product (and anything computed from it) -> (q, k, module stack) with q, k as
        (..., L, E), (..., S, E)."""
        self.stack = stack
        self.graded: dict[tuple[Any, ...], torch.Tensor] = {}
        """(storage, offset, shape, strides, dtype) -> the last recorded tensor with autograd history there."""

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # a compiled call inside the traced forward: not followed
            return func(*args, **kwargs)
        t = self.trace
        index = t.ops
        t.ops += 1
        inputs = [x for a in (*args, *kwargs.values()) for x in _tensors(a)]
        call: AttentionCall | None = None
        if func is SDPA:
            q = args[0] if args else kwargs.get("query")
            k = args[1] if len(args) > 1 else kwargs.get("key")
            call = AttentionCall(index, "sdpa", tuple(self.stack), q, k, None)
        elif func is F.multi_head_attention_forward:
            query = args[0] if args else kwargs.get("query")
            key = args[1] if len(args) > 1 else kwargs.get("key")
            call = AttentionCall(index, "torch_mha", tuple(self.stack), None, None, None, id(query), id(key))
        elif func in SOFTMAXES:
            call = self._eager_call(index, args, kwargs)
        else:
            kernel = kernels.lookup(func)
            if kernel is not None:
                call = self._kernel_call(index, kernel, func, args, kwargs)
            elif kernels.is_op(func):
                self._note_opaque(func, inputs)
        out = func(*args, **kwargs)
        if func in _TOPK and inputs and isinstance(out, tuple) and len(out) == 2:
            t.selections.append(Selection(index, id(inputs[0]), id(out[0]), id(out[1])))
        if func in _MIXING:
            t.mixing.append(index)
        out = self._projection(func, index, args, kwargs, out)
        outputs = list(_tensors(out))
        in_ids = {id(x) for x in inputs}
        for o in outputs:
            oid = id(o)
            t.parents.setdefault(oid, set()).update(in_ids - {oid})
            t.op_name.setdefault(oid, getattr(func, "__name__", str(func)))
            t.created.setdefault(oid, index)
            t.shapes[oid] = tuple(o.shape)
        for x in inputs:
            t.shapes.setdefault(id(x), tuple(x.shape))
        for o in outputs:
            if o.requires_grad and o.is_floating_point():
                self.graded[_layout(o)] = o
        t.keep.append((inputs, outputs))
        if in_ids and in_ids <= self.param_like:
            self.param_like.update(id(o) for o in outputs)
        projected = bool(t.projections) and t.projections[-1].index == index
        if func not in SOFTMAXES and not projected:  # logits stop at their softmax and at a projection
            self._follow_products(func, args, kwargs, inputs, outputs)
        if call is not None:
            call.output = id(outputs[0]) if outputs else None
            t.calls.append(call)
        return out

    # ------------------------------------------------------------ projections
    def _operands(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any] | None:
        if kind == "linear":
            return args[0] if args else kwargs.get("input"), args[1] if len(args) > 1 else kwargs.get(
                "weight"
            )
        if kind in ("addmm", "baddbmm"):
            rest = list(args[1:3]) + [
                kwargs.get(n) for n in ("mat1", "mat2", "batch1", "batch2") if n in kwargs
            ]
            return (rest[0], rest[1]) if len(rest) >= 2 else None
        if kind == "einsum":
            ops = args[1:]
            if len(ops) == 1 and isinstance(ops[0], list | tuple):
                ops = tuple(ops[0])
            return (ops[0], ops[1]) if len(ops) == 2 else None
        return (args[0], args[1]) if len(args) >= 2 else None

    def _projection(
        self, func: Callable[..., Any], index: int, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> Any:
        kind = LINEAR.get(func)
        if kind is None and func is _RMATMUL:
            kind, args = "matmul", (args[1], args[0])
        if kind is None or not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return out
        operands = self._operands(kind, args, kwargs)
        if operands is None or not all(isinstance(o, torch.Tensor) for o in operands):
            return out
        a, b = operands
        a_param, b_param = id(a) in self.param_like, id(b) in self.param_like
        if a_param == b_param:
            if not a_param and out.dim() >= 3:
                self.trace.mixing.append(index)
                self._record_product(kind, args, a, b, out)
            return out
        act, weight = (b, a) if a_param else (a, b)
        leaf = out.detach().requires_grad_(True)
        handed = leaf.clone()
        name = self.param_names.get(id(weight), self._param_source(weight))
        axis = _weight_axis(kind, args, weight, a_param) if id(weight) in self.param_names else None
        self.trace.projections.append(
            Projection(index, name, self.stack[-1] if self.stack else "", id(act), id(handed), leaf, axis)
        )
        return handed

    def _param_source(self, tensor: torch.Tensor) -> str:
        """Name of the parameter a parameter-derived tensor (``w.T``, ``w.to(bf16)``) came from."""
        todo, seen = [id(tensor)], set()
        while todo:
            n = todo.pop()
            if n in self.param_names:
                return self.param_names[n]
            seen.add(n)
            todo.extend(p for p in self.trace.parents.get(n, ()) if p not in seen)
        return "?"

    # ------------------------------------------------------------ kernels
    def _kernel_call(
        self, index: int, kernel: kernels.Kernel, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> AttentionCall:
        # a kernel wrapped in an autograd.Function gets its arguments without autograd history: read the
        # recorded tensors they are (same storage and layout) so that q and k lead back to projections
        args = tuple(self._with_history(a) for a in args)
        kwargs = {n: self._with_history(a) for n, a in kwargs.items()}
        try:
            with (
                torch.enable_grad()
            ):  # inside an autograd.Function's forward gradients are off: views keep history
                qk = kernels.read_call(kernel, func, args, kwargs)
        except Exception as exc:  # a call the reader refuses: the site is known, its q/k are not
            call = AttentionCall(index, f"kernel:{kernel.name}", tuple(self.stack), None, None, None)
            call.note = f"{kernel.library} call not readable: {exc}"
            return call
        inputs = [x for a in (*args, *kwargs.values()) for x in _tensors(a)]
        q, k = self._view_of(qk.q, inputs), self._view_of(qk.k, inputs)
        return AttentionCall(index, f"kernel:{kernel.name}", tuple(self.stack), q, k, None)

    def _with_history(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.requires_grad or not x.is_floating_point():
            return x
        return self.graded.get(_layout(x), x)

    def _view_of(self, view: torch.Tensor, inputs: list[torch.Tensor]) -> torch.Tensor:
        """Enter a reader's view (e.g. (B, L, H, D) -> (B, H, L, D)) into the data-flow graph as
        derived from the call argument it views."""
        if id(view) in self.trace.created:
            return view
        ptr = view.untyped_storage().data_ptr()
        source = next((x for x in inputs if x.untyped_storage().data_ptr() == ptr), None)
        return self._derived(view, source) if source is not None else view

    def _note_opaque(self, func: Any, inputs: list[torch.Tensor]) -> None:
        name = kernels.op_name(func) or str(func)
        if name.split("::")[0] in ("aten", "prims", "profiler", "_c10d_functional", "c10d", "inductor"):
            return
        if sum(1 for x in inputs if x.is_floating_point() and x.dim() >= 3) >= 2:
            self.trace.opaque_ops.append((name, tuple(self.stack)))

    # ------------------------------------------------------------ eager attention
    def _record_product(self, kind: str, args: tuple[Any, ...], a: Any, b: Any, out: torch.Tensor) -> None:
        """Remember a product of two activations that may be attention logits, as (q, k)."""
        if kind == "einsum":
            m = _EINSUM_TERM.match(str(args[0]).replace(" ", ""))
            if m is None:
                return
            lhs, rhs, res = m.groups()
            if not (
                len(lhs) == len(res) and lhs[-1] == rhs[-1] and lhs[-1] not in res and rhs[-2] == res[-1]
            ):
                return
            if len(rhs) == len(lhs) - 1 and b.dim() == a.dim() - 1:  # one key head shared (MQA): "bhid,bjd"
                b = self._derived(b.unsqueeze(-3), b)
            elif len(rhs) != len(lhs):
                return
            self.products[id(out)] = (a, b, tuple(self.stack))  # "...ld,...sd->...ls"
        else:
            self.products[id(out)] = (a, self._derived(b.transpose(-2, -1), b), tuple(self.stack))

    def _derived(self, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """Enter a tensor the trace made itself (a view of `old`) into the data-flow graph."""
        t = self.trace
        t.parents[id(new)] = {id(old)}
        t.created[id(new)] = t.created.get(id(old), t.ops)
        t.shapes[id(new)] = tuple(new.shape)
        t.keep.append(new)
        return new

    def _follow_products(
        self,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor],
    ) -> None:
        for x in inputs:
            origin = self.products.get(id(x))
            if origin is not None:
                for o in outputs:
                    self.products.setdefault(id(o), origin)
                return

    def _eager_call(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> AttentionCall | None:
        x = args[0] if args else kwargs.get("input")
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if not isinstance(x, torch.Tensor) or x.dim() != 4 or dim not in (-1, 3):
            return None
        origin = self.products.get(id(x))
        if origin is None:
            return None
        q, k, product_stack = origin
        # the scope is the innermost module running both the product and the softmax (timm calls an
        # nn.Softmax module: its parent is the attention)
        stack = tuple(p for p, r in zip(self.stack, product_stack) if p == r)
        if q.dim() == 3 and k.dim() == 3:  # (B·H, L, E) as in Bloom's baddbmm: heads folded into the batch
            b, h = x.shape[0], x.shape[1]
            q = self._derived(q.reshape(b, h, *q.shape[-2:]), q)
            k = self._derived(k.reshape(b, h, *k.shape[-2:]), k)
        if q.dim() != 4 or k.dim() != 4:
            return None
        call = AttentionCall(index, "eager", stack, q, k, None)
        call.shifted = self._row_max_shifted(x)
        call.sink_columns = max(0, int(x.shape[-1]) - int(k.shape[-2]))
        return call

    def _row_max_shifted(self, x: torch.Tensor) -> bool:
        """True when `x` was made as ``y - max(y, -1, keepdim=True)`` (a stable softmax done by hand)."""
        t = self.trace
        if t.op_name.get(id(x)) not in ("sub", "__sub__"):
            return False
        parents = t.parents.get(id(x), set())
        return any(
            t.op_name.get(p) in ("max", "amax") and bool((parents - {p}) & t.parents.get(p, set()))
            for p in parents
        )


@contextmanager
def _module_stack(model: nn.Module, trace: Trace, stack: list[str]) -> Iterator[None]:
    """Hooks on every module keeping `stack` (paths of running modules) and `trace.modules` up to
    date: the pre-hook runs first and the post-hook last, so a module's output is recorded after
    its own hooks (e.g. an intervention's) changed it."""
    open_calls: list[ModuleCall] = []

    def pre(path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            first = first_tensor_in(list(args) + list(kwargs.values()))
            call = ModuleCall(path, trace.ops, input=id(first) if first is not None else None)
            trace.modules.append(call)
            open_calls.append(call)
            stack.append(path)

        return hook

    def post(path: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not open_calls or open_calls[-1].path != path:
                return
            call = open_calls.pop()
            stack.pop()
            call.end = trace.ops
            out = first_tensor_in(output)
            call.output = id(out) if out is not None else None
            if isinstance(output, tuple | list):
                call.outputs = tuple(id(o) if isinstance(o, torch.Tensor) else None for o in output)
            trace.keep.append(output)

        return hook

    handles = []
    try:
        for path, module in model.named_modules():
            handles.append(module.register_forward_pre_hook(pre(path), prepend=True, with_kwargs=True))
            handles.append(module.register_forward_hook(post(path), always_call=True))
        yield
    finally:
        for h in handles:
            h.remove()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece (compared without a collective), else `t`."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


@contextmanager
def _model_unchanged(model: nn.Module) -> Iterator[None]:
    """Restore the RNG streams and every buffer after the traced forward (nothing about training changes)."""
    buffers = [(b, b.detach().clone()) for b in model.buffers() if b.device.type != "meta"]
    devices: list[int] = []
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = list(range(torch.cuda.device_count()))
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for buf, saved in buffers:
                    # only a changed buffer: a copy bumps its version, and the traced graph (followed
                    # back afterwards) may have saved a view of it (a rotary table under tensor parallel)
                    if not torch.equal(_local(buf), _local(saved)):
                        buf.copy_(saved)


def run_trace(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Trace:
    """Run ``model(*args, **kwargs)`` once under the trace and return what it recorded.

    Gradients are enabled for the pass (so q and k can be followed back to their projections); no
    parameter gradient is ever computed. The RNG streams and buffers are restored afterwards.
    """
    trace = Trace()
    params = {id(p): n for n, p in model.named_parameters()}
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    trace.device_type = device.type
    stack: list[str] = []
    recorder = _Recorder(trace, params, stack)
    with (
        kernels.install((model,)),
        _tracing(),
        _model_unchanged(model),
        torch.inference_mode(False),
        torch.enable_grad(),
        _module_stack(model, trace, stack),
        recorder,
    ):
        trace.output = model(*args, **kwargs)
    trace.param_like = recorder.param_like
    return trace


def is_add(op_name: str) -> bool:
    """True for the op names an elementwise addition of two tensors records."""
    return op_name in {"add", "__add__", "__radd__", "add_", "__iadd__"}
