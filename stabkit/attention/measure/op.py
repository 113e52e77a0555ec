"""The attention probe's measurement as opaque ops, for compiled models: ``torch.ops.stabkit.attention_qk``
and ``torch.ops.stabkit.attention_logits``.

When it runs: the attention probe's handler calls these while Dynamo traces an attention module
on a sampled step (`stabkit.attention.scope`); the op runs, as one node of the compiled graph, each
time that graph runs. Its body is the eager measurement (`stabkit.attention.measure.measure.measure`, the same
blocks within `MonitorConfig.attn_chunk_bytes`) on the sample `Sampling` picks from the device round
(`stabkit.probes.base.StepPhase.round`: index tensors, no recompile per round), followed by the
probe's summary (`summary_values`: the probe's ``_record``, value for value), returned as one vector
in `stabkit.stats.Recorder.add_packed`'s form. Why an op rather than traced code: see
`stabkit.stats.opaque` (no generated code, kernels shared by the sampled and unsampled graphs, the
eager numbers).

A call the ops cannot take — a kernel's position masks (windows, chunks, packed documents, ALiBi),
FlexAttention's block mask or score_mod (callables cannot cross an op) — is measured by the same
code traced into the graph instead (`traced_values`).
"""

from __future__ import annotations

from typing import Any

import torch

from ...stats.opaque import gate_open, opaque_fake, opaque_op, packed
from ...stats.recorder import Combine, Reduction
from ..call import LogitsCall, QKCall
from .measure import measure
from .stats import HeadStats, Sampling, uncap

Entry = tuple[str, Combine, Reduction]
"""(metric name under ``attn/<path>/``, combine over micro-batches, cross-rank reduction)."""


def layout(heads: int, sinks: bool, capped: bool, per_head: bool) -> list[Entry]:
    """The statistics of one measured call, in the order `summary_values` gives them."""
    out: list[Entry] = [("max_logit", "max", "max")]
    if capped:
        out.append(("max_logit_capped", "max", "max"))
    out += [("entropy", "mean", "mean"), ("min_head_entropy", "min", "min")]
    out += [("sink_heads", "mean", "mean"), ("first_key_mass", "max", "max")]
    if sinks:
        out.append(("sink_mass", "mean", "mean"))
    if per_head:
        for h in range(heads):
            out += [(f"head.{h}/max_logit", "max", "max"), (f"head.{h}/entropy", "mean", "mean")]
            out.append((f"head.{h}/first_key_mass", "mean", "mean"))
            if sinks:
                out.append((f"head.{h}/sink_mass", "mean", "mean"))
    return out


def summary_values(
    stats: HeadStats, seen_capped: float | None, applied_cap: float | None, per_head: bool
) -> list[torch.Tensor]:
    """The values of `layout` (0-d float32), computed as the probe's eager ``_record`` computes them;
    of stacked calls (`HeadStats.stacked`), one (C,) vector per entry."""
    top = stats.max_logit.amax(dim=-1)
    if seen_capped is not None:
        out = [uncap(top, seen_capped), top]
    else:
        out = [top]
        if applied_cap is not None:
            out.append(applied_cap * torch.tanh(top / applied_cap))
    out += [stats.entropy(), stats.min_head_entropy(), *stats.attention_sinks()]
    sink = stats.sink_mass()
    if sink is not None:
        out.append(sink.mean(dim=-1))
    if per_head:
        head_max = stats.max_logit if seen_capped is None else uncap(stats.max_logit, seen_capped)
        head_ent, head_first = stats.head_entropy(), stats.first_key_mass()
        for h in range(head_max.shape[-1]):
            out += [head_max[..., h], head_ent[..., h], head_first[..., h]]
            if sink is not None:
                out.append(sink[..., h])
    return out


def op_sampling(rows: int | None, queries: int | None, round_: torch.Tensor) -> Sampling:
    """The sample of an op's call (run time, inside the op). On a CPU the round is read — host memory,
    no device sync — so the sample is slices, as eager monitoring takes it: the same rows, and the
    one-block path (`stabkit.attention.measure.fast`) where it applies, ~1.5× faster than the blocked path that
    index tensors need. On an accelerator the round stays on the device (index tensors: a host read
    there would synchronise)."""
    if round_.device.type == "cpu":
        return Sampling(rows, queries, int(round_))
    return Sampling(rows, queries, counter=round_)


def opaque_ok(call: QKCall | LogitsCall) -> bool:
    """True when the ops can take `call` (no position masks, FlexAttention mask or score_mod)."""
    if isinstance(call, LogitsCall):
        return True
    return call.positions is None and call.flex is None and call.score_mod is None and not call.score_args


@opaque_op(
    "attention_qk",
    "(Tensor q, Tensor k, Tensor? allowed, Tensor? bias, Tensor? sinks, Tensor round_, bool causal, "
    "float? scale, float? softcap, float? applied_cap, float? seen_capped, int? rows, int? queries, "
    "int budget, bool per_head, int gate, int every) -> Tensor",
)
def attention_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    allowed: torch.Tensor | None,
    bias: torch.Tensor | None,
    sinks: torch.Tensor | None,
    round_: torch.Tensor,
    causal: bool,
    scale: float | None,
    softcap: float | None,
    applied_cap: float | None,
    seen_capped: float | None,
    rows: int | None,
    queries: int | None,
    budget: int,
    per_head: bool,
    gate: int,
    every: int,
) -> torch.Tensor:
    """Statistics of one q/k attention call (`layout` order, then the count 1; zeros when `gate`
    says the step is not sampled: `stabkit.stats.opaque.gate_open`)."""
    if not gate_open(gate, every):
        capped = seen_capped is not None or applied_cap is not None
        return torch.zeros(len(layout(q.shape[1], sinks is not None, capped, per_head)) + 1, device=q.device)
    call = QKCall(q, k, scale, allowed=allowed, bias=bias, causal=causal, softcap=softcap, sinks=sinks)
    with torch.no_grad():
        stats = measure(call, op_sampling(rows, queries, round_), applied_cap, budget)
        return packed(summary_values(stats, seen_capped, applied_cap, per_head))


@opaque_fake("attention_qk")
def _(q: torch.Tensor, k: torch.Tensor, allowed: Any, bias: Any, sinks: Any, *rest: Any) -> torch.Tensor:
    applied_cap, seen_capped, per_head = (
        rest[4],
        rest[5],
        rest[9],
    )  # rest: round_, causal, scale, softcap, ...
    n = len(
        layout(q.shape[1], sinks is not None, seen_capped is not None or applied_cap is not None, per_head)
    )
    return q.new_empty((n + 1,), dtype=torch.float32)


@opaque_op(
    "attention_logits",
    "(Tensor x, Tensor round_, int sink_columns, float? applied_cap, float? seen_capped, int? rows, "
    "int? queries, int budget, bool per_head, int gate, int every) -> Tensor",
)
def attention_logits(
    x: torch.Tensor,
    round_: torch.Tensor,
    sink_columns: int,
    applied_cap: float | None,
    seen_capped: float | None,
    rows: int | None,
    queries: int | None,
    budget: int,
    per_head: bool,
    gate: int,
    every: int,
) -> torch.Tensor:
    """Statistics of one eager softmax call over (B, H, L, S) logits (`layout` order, then the count 1;
    zeros when `gate` says the step is not sampled)."""
    if not gate_open(gate, every):
        capped = seen_capped is not None or applied_cap is not None
        return torch.zeros(len(layout(x.shape[1], sink_columns > 0, capped, per_head)) + 1, device=x.device)
    with torch.no_grad():
        stats = measure(LogitsCall(x, sink_columns), op_sampling(rows, queries, round_), applied_cap, budget)
        return packed(summary_values(stats, seen_capped, applied_cap, per_head))


@opaque_fake("attention_logits")
def _(
    x: torch.Tensor,
    round_: torch.Tensor,
    sink_columns: int,
    applied_cap: float | None,
    seen_capped: float | None,
    *rest: Any,
) -> torch.Tensor:
    per_head = rest[-3]  # rest: rows, queries, budget, per_head, gate, every
    n = len(
        layout(x.shape[1], sink_columns > 0, seen_capped is not None or applied_cap is not None, per_head)
    )
    return x.new_empty((n + 1,), dtype=torch.float32)


def measured(
    call: QKCall | LogitsCall,
    sampling: Sampling,
    applied_cap: float | None,
    seen_capped: float | None,
    budget: int,
    per_head: bool,
    gate: int,
    every: int,
) -> tuple[list[Entry], torch.Tensor]:
    """Under torch.compile: the layout of one call's statistics and their packed vector — from an
    opaque op when `opaque_ok` (asking `gate` at run time), else from the measurement traced into
    the graph (the caller only traces it into a sampled graph)."""
    assert sampling.counter is not None
    rows, queries, round_ = sampling.rows, sampling.queries, sampling.counter
    if isinstance(call, LogitsCall):
        heads, sinks = call.x.shape[1], call.sink_columns > 0
        vector = torch.ops.stabkit.attention_logits(
            call.x,
            round_,
            call.sink_columns,
            applied_cap,
            seen_capped,
            rows,
            queries,
            budget,
            per_head,
            gate,
            every,
        )
    elif opaque_ok(call):
        heads, sinks = call.q.shape[1], call.sinks is not None
        sink_logits = None if call.sinks is None else call.sinks.detach()
        vector = torch.ops.stabkit.attention_qk(
            call.q.detach(),
            call.k.detach(),
            call.allowed,
            None if call.bias is None else call.bias.detach(),
            sink_logits,
            round_,
            call.causal,
            call.scale,
            call.softcap,
            applied_cap,
            seen_capped,
            rows,
            queries,
            budget,
            per_head,
            gate,
            every,
        )
    else:  # traced: the same measurement as graph ops
        heads, sinks = call.q.shape[1], call.sinks is not None
        vector = packed(
            summary_values(measure(call, sampling, applied_cap, budget), seen_capped, applied_cap, per_head)
        )
    capped = seen_capped is not None or applied_cap is not None
    return layout(heads, sinks, capped, per_head), vector
