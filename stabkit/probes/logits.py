"""Output-logit probe: max |logit|, log Z (mean, max) and the mean logit of the model's final logits.

A forward hook where discovery found the final logits (`ModelMap.logits`: the output head, or the
model's own output when it scales or caps after the head), on sampled steps, in training forwards
only (`ProbeContext.training_forward`). log Z = logsumexp over the vocabulary; its drift is the
output-logit divergence of Wortsman et al. 2023, who plot it as the mean output logit (over the
vocabulary and positions) drifting far negative: `logits/mean`.

Under tensor parallelism with loss parallel the logits are a DTensor sharded over the vocabulary:
`dtensor_logit_stats` completes each row's log Z with one small all-gather.

Under ``torch.compile`` the hook is traced into the sampled graph and measures through the opaque
op ``torch.ops.stabkit.logit_stats`` (`stabkit.stats.opaque`: the eager code, one graph output), or,
measured on every step (full monitoring), through the same code traced into the graph.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import is_dtensor
from ..stats import logit_stats
from ..stats.opaque import LOGIT_COMBINES, logit_values
from ..stats.recorder import Reduction
from ..stats.reductions import logz_chunk_rows
from .base import Probe, ProbeContext, first_tensor, guarded

NAMES = ("logits/max_abs", "logits/logz_mean", "logits/logz_max", "logits/mean")
REDUCTIONS: tuple[Reduction, ...] = ("max", "mean", "max", "mean")


class LogitProbe(Probe):
    """Writes `logits/max_abs`, `logits/logz_mean`, `logits/logz_max`, `logits/mean`."""

    name = "logits"
    families = frozenset({"logits"})

    def attach(self, ctx: ProbeContext) -> None:
        super().attach(ctx)
        where = ctx.model_map.logits
        if where is None:
            return
        self.where = where
        module = ctx.model.get_submodule(where.path)
        self.watch_forwards()
        self.handles.append(ctx.hooks.forward(self.name, module, self._hook, cadence=ctx.config.every))

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        ctx = self.ctx
        assert ctx is not None
        if not (self.enabled and ctx.sampled() and ctx.training_forward(module)):
            return
        logits = self.where.take(output)
        if logits is not None:
            self._measure(logits)

    @guarded
    def _measure(self, output: Any) -> None:
        """Forward hook body (after the module that yields the final logits, sampled training forwards)."""
        ctx = self.ctx
        assert ctx is not None
        if torch.compiler.is_compiling():  # every step: fused graph ops; sampled: one opaque op
            x = first_tensor(output).detach()
            packed, gated = ctx.compiled_values(
                None if is_dtensor(x) else lambda: logit_values(x),
                lambda gate, every: torch.ops.stabkit.logit_stats(x, gate, every),
            )
            ctx.recorder.add_packed(NAMES, LOGIT_COMBINES, REDUCTIONS, packed, every=gated)
            return
        logits = first_tensor(output)
        if is_dtensor(logits):  # tensor parallel: loss_parallel keeps the logits sharded by vocabulary
            max_abs, logz_mean, logz_max, mean = dtensor_logit_stats(logits)
        else:
            max_abs, logz_mean, logz_max, mean = logit_stats(logits)
        rec = ctx.recorder
        rec.add("logits/max_abs", max_abs, combine="max", reduction="max")
        rec.add("logits/logz_mean", logz_mean, combine="mean", reduction="mean")
        rec.add("logits/logz_max", logz_max, combine="max", reduction="max")
        rec.add("logits/mean", mean, combine="mean", reduction="mean")


def dtensor_logit_stats(logits: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`logit_stats` of DTensor logits, exact: sharded over the vocabulary on one mesh dimension (and
    replicated on the others), each rank reduces its vocabulary shard per row (log Z, max |logit|,
    sum) and one all-gather of these (N, 3) values over that dimension completes every row; any other
    layout is gathered whole (`full_tensor`). Runs in the logit probe's forward hook on sampled steps,
    on every rank (a collective)."""
    last = logits.ndim - 1
    placements = list(logits.placements)
    vocab = [i for i, p in enumerate(placements) if p.is_shard() and p.dim in (last, -1)]
    if len(vocab) != 1 or not all(p.is_replicate() for i, p in enumerate(placements) if i != vocab[0]):
        return logit_stats(logits.full_tensor())
    flat = logits.to_local().detach().reshape(-1, logits.to_local().shape[-1])  # (N, V / shards)
    parts = torch.cat(
        [
            torch.stack([torch.logsumexp(c, -1), c.abs().amax(-1), c.sum(-1)], -1)  # (rows, 3)
            for c in (chunk.float() for chunk in flat.split(logz_chunk_rows(*flat.shape)))
        ]
    )
    group = logits.device_mesh.get_group(vocab[0])
    shards = dist.get_world_size(group)
    flat_out = parts.new_empty(shards * parts.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(flat_out, parts.reshape(-1), group=group)
    gathered = flat_out.view(shards, *parts.shape)  # (shards, N, 3)
    logz = torch.logsumexp(gathered[..., 0], 0)  # (N,)
    rows = max(1, logz.numel())
    return (
        gathered[..., 1].amax(),
        logz.sum() / rows,
        logz.amax(),
        gathered[..., 2].sum() / (rows * logits.shape[-1]),
    )
