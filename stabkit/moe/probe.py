"""MoE probe: per MoE layer, tokens per expert and the router's entropy, margin, logit max and log Z.

A forward hook on each router discovery found (`ModelMap.moe`, `stabkit.moe.find`), on sampled
training forwards only, reads the router logits and chosen experts from the router's own output
(or recomputes the choice, `MoEMap.indices` None) and records device tensors (`stabkit.moe.stats`);
no host sync. A forward hook on the model reads the model's own auxiliary loss when its output has one
(HF ``output_router_logits=True``: ``moe/aux_loss``). At each log interval, after the host copy and the
cross-rank sum of the counts, `finish_rows` adds the load ratios (`stabkit.moe.finish`).

Metrics: ``moe/<layer>/load[e]`` (sum over micro-batches and ranks), ``moe/<layer>/{entropy, margin,
logz_mean}`` (mean), ``moe/<layer>/{logz_max, logit_max}`` (max), then ``max_vio``, ``cv``,
``busiest_share``, ``dead_experts`` from the counts.

Distributed: under DDP and FSDP2 every rank routes its own tokens, so summing the counts over ranks
gives the batch's load; under expert parallelism the router still runs on each rank's own tokens
before the all-to-all, and the same holds. Under FSDP2 discovery traces no forward (sharded
parameters): inspect the model before ``fully_shard`` and pass that map to `attach`.

Under ``torch.compile`` the router hook is traced into the model's graph as one opaque op
(`stabkit.moe.compiled`: the same statistics, gated at run time; one graph, no break) and the aux loss as
a graph op; the load ratios are taken on the host from the summed counts as in eager mode.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from ..metric_names import MOE, metric
from ..plugins import PROBES
from ..probes.base import Probe, ProbeContext, guarded
from .compiled import SCORINGS, packed_combines, packed_reductions
from .finish import LoadFinisher, load_name
from .map import MoEMap
from .stats import MAXES, MEANS, routing_stats

DEAD_WINDOW = 100
"""Steps without a token after which an expert counts as dead."""


class _Layer:
    """What the hook of one MoE layer needs, resolved once at attach."""

    def __init__(self, model: nn.Module, moe: MoEMap) -> None:
        self.moe = moe
        self.load_names = tuple(load_name(moe.path, e) for e in range(moe.n_experts))
        self.mean_names = tuple(metric(MOE, moe.path, s) for s in MEANS)
        self.max_names = tuple(metric(MOE, moe.path, s) for s in MAXES)
        self.bias: torch.Tensor | None = None
        if moe.score_bias is not None:
            owner, _, leaf = moe.score_bias.rpartition(".")
            self.bias = getattr(model.get_submodule(owner), leaf)
        assert moe.logits is not None
        self.logits = moe.logits
        same = moe.indices is not None and moe.indices.path == moe.logits.path
        self.indices = moe.indices if same else None
        self.packed_names = (*self.load_names, *self.mean_names, *self.max_names)
        self.combines = packed_combines(moe.n_experts)
        self.reductions = packed_reductions(moe.n_experts)


@PROBES.register
class MoEProbe(Probe):
    """Writes the ``moe/`` family (see the module docstring)."""

    name = "moe"
    families = frozenset({"moe"})

    def attach(self, ctx: ProbeContext) -> None:
        super().attach(ctx)
        self.finisher = LoadFinisher(DEAD_WINDOW, ctx.step())
        layers = [_Layer(ctx.model, m) for m in ctx.model_map.moe if m.logits is not None]
        if not layers:
            return
        self.watch_forwards()
        for layer in layers:
            module = ctx.model.get_submodule(layer.logits.path)
            self.handles.append(
                ctx.hooks.forward(self.name, module, partial(self._hook, layer), cadence=ctx.config.every)
            )
        self.handles.append(ctx.hooks.forward(self.name, ctx.model, self._aux_hook, cadence=ctx.config.every))

    def _hook(self, layer: _Layer, module: nn.Module, args: Any, output: Any) -> None:
        ctx = self.ctx
        assert ctx is not None
        if self.enabled and ctx.sampled() and ctx.training_forward(module):
            self._measure(layer, output)

    @guarded
    def _measure(self, layer: _Layer, output: Any) -> None:
        """Forward hook body (after a router, sampled training forwards): device statistics only."""
        ctx = self.ctx
        assert ctx is not None
        logits = layer.logits.take(output)
        if logits is None:
            raise TypeError(f"the router's output has no logits at {layer.logits}")
        indices = layer.indices.take(output) if layer.indices is not None else None
        moe = layer.moe
        if torch.compiler.is_compiling():  # one opaque op, gated at run time (`stabkit.moe.compiled`)
            logits, scoring = logits.detach(), SCORINGS.index(moe.scoring)
            index = indices.detach() if indices is not None else None
            values, every = ctx.compiled_values(
                None,
                lambda gate, every: torch.ops.stabkit.moe_stats(
                    logits, index, layer.bias, moe.n_experts, moe.top_k, scoring, gate, every
                ),
            )
            ctx.recorder.add_packed(layer.packed_names, layer.combines, layer.reductions, values, every)
            return
        load, means, maxes = routing_stats(logits, indices, moe.n_experts, moe.top_k, moe.scoring, layer.bias)
        rec = ctx.recorder
        rec.add_vector(layer.load_names, load, combine="sum", reduction="sum")
        rec.add_vector(layer.mean_names, means, combine="mean", reduction="mean")
        rec.add_vector(layer.max_names, maxes, combine="max", reduction="max")

    def _aux_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        ctx = self.ctx
        assert ctx is not None
        aux = getattr(output, "aux_loss", None)
        if isinstance(aux, torch.Tensor) and self.enabled and ctx.sampled() and ctx.training_forward(module):
            ctx.recorder.add(metric(MOE, "", "aux_loss"), aux.detach(), combine="mean", reduction="mean")

    def finish_rows(self, rows: list[tuple[int, dict[str, float]]]) -> None:
        """At the log interval, on the host, after the cross-rank reduction: the load ratios."""
        self.finisher.finish(rows)
