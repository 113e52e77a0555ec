"""Outlier probe: massive activations and outlier features of each block's output (the residual stream).

Forward hooks on the blocks discovery found (those `MonitorConfig.modules` selects, when it is set),
active on the steps of the whole-model statistics (`MonitorConfig.deep_every`: every 5th sampled
step by default; each block output is read several times) in training forwards only; it serves the
``act`` family. Per block ``b`` (definitions: `stabkit.stats.outliers`):

- ``act/<b>/massive_ratio``: the largest |x| of a token over that token's median |x|, max over tokens
  (Sun et al. 2024: massive activations ~1000× the median, in fixed channels);
- ``act/<b>/massive_dim``: the channel of the largest |x| (a fixed channel is the signature);
- ``act/<b>/kurtosis``: the excess kurtosis of the per-channel RMS (outlier features: He et al.,
  NeurIPS 2024; OSP reports 1818 with Adam against 0.04 — FOG's predictor of fp8 divergence).

The largest |x| itself is the activation probe's ``act/<b>/absmax``. Under ``torch.compile`` the
statistics come from the opaque op ``torch.ops.stabkit.outlier_stats`` (`stabkit.stats.opaque`: the
eager code, one graph output; a gated phase's op decides at run time), or, measured on every step
(full monitoring), from the same code traced into the graph, where Inductor reads the block output
for them in the kernels that write it. No host sync.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..distributed import is_dtensor, local
from ..metric_names import ACT, metric, path_of
from ..stats.opaque import OUTLIER_COMBINES, outlier_values
from ..stats.outliers import OutlierReductions, finish_outliers_stacked, reduce_outliers, stack_key
from ..stats.recorder import Reduction
from .base import Probe, ProbeContext, first_tensor, guarded, select_modules
from .split_exact import record_channel_parts

STATS = ("massive_ratio", "massive_dim", "kurtosis")
"""The statistics of a block output, in `outlier_stats` order."""
REDUCTIONS: tuple[Reduction, ...] = ("max", "max", "mean")
"""Cross-rank reductions of the massive ratio, its channel and the channel-RMS kurtosis."""


class OutlierProbe(Probe):
    """Writes `act/<block>/massive_ratio`, `act/<block>/massive_dim`, `act/<block>/kurtosis` every
    `MonitorConfig.deep_every` steps."""

    name = "outliers"
    families = frozenset({"act"})

    def attach(self, ctx: ProbeContext) -> None:
        super().attach(ctx)
        blocks = list(ctx.model_map.block_paths)
        chosen = set(select_modules(ctx.model, ctx.config.modules, blocks))
        self.paths = [p for p in blocks if p in chosen]
        self._kept: list[tuple[tuple[str, ...], OutlierReductions]] = []
        """This step's reduced block outputs, finished at the step's first read (`_finish`)."""
        self.watch_forwards()
        for path in self.paths:
            module = ctx.model.get_submodule(path)
            self.handles.append(
                ctx.hooks.forward(self.name, module, self._make_hook(path), cadence=ctx.phase.deep_every)
            )

    def _make_hook(self, path: str) -> Any:
        names = tuple(metric(ACT, path, s) for s in STATS)

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            ctx = self.ctx
            assert ctx is not None
            # eager: on the whole-model statistics' steps; traced: in the sampled graph (the
            # cadence is the ops' and the Recorder's business: `ProbeContext.compiled_values`)
            every = None if torch.compiler.is_compiling() else ctx.phase.deep_every
            if self.enabled and ctx.sampled(every) and ctx.training_forward(module):
                self._measure(names, output)

        return hook

    @guarded
    def _measure(self, names: tuple[str, ...], output: Any) -> None:
        """Forward hook body (after a block's forward, in a sampled training forward)."""
        ctx = self.ctx
        assert ctx is not None
        x = first_tensor(output)
        if is_dtensor(x):  # tensor parallel: this rank's piece
            x = local(x)
        if torch.compiler.is_compiling():  # every step: fused graph ops; sampled: one opaque op
            x = x.detach()
            values = ctx.compiled_values(
                lambda: outlier_values(x),
                lambda gate, every: torch.ops.stabkit.outlier_stats(x, gate, every),
                ctx.phase.deep_every,
            )
            ctx.recorder.add_packed(names, OUTLIER_COMBINES, REDUCTIONS, *values)
            return
        kept = reduce_outliers(x)
        if kept is None:
            return
        if ctx.facts.dist.world_size > 1:  # parts for a kurtosis and channel exact across ranks
            record_channel_parts(ctx.recorder, path_of(names[0]), x)
        self._kept.append((names, kept))
        ctx.recorder.defer(self._finish)  # the small ops run later, with every block's

    @guarded
    def _finish(self) -> None:
        """Before the step's statistics are read (`Recorder.defer`): the statistics of every block
        output the hooks reduced since."""
        ctx = self.ctx
        kept, self._kept = self._kept, []
        if ctx is None:
            return
        groups: dict[tuple[object, ...], list[tuple[tuple[str, ...], OutlierReductions]]] = {}
        for names, reductions in kept:  # blocks of one shape finish together
            groups.setdefault(stack_key(reductions), []).append((names, reductions))
        for group in groups.values():
            values = finish_outliers_stacked([r for _, r in group])  # three (n,) vectors
            for i, (value, combine, reduction) in enumerate(
                zip(values, OUTLIER_COMBINES, REDUCTIONS, strict=True)
            ):
                names = tuple(n[i] for n, _ in group)
                ctx.recorder.add_vector(names, value, combine=combine, reduction=reduction)
