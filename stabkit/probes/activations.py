"""Activation probe: RMS, abs-max and non-finite count of selected modules' outputs.

Forward hooks, active on sampled steps and in training forwards only (not in evaluation,
generation, no-grad forwards, nor the recomputation of activation checkpointing: see
`ProbeContext.training_forward`). Eager, a hook makes only the reductions that read the output (a
norm and a min/max, `stabkit.stats.tensor_batch`); the statistics of all outputs are finished
together, as vectors, when the step's statistics are first read (`Recorder.defer`). The block modules' outputs are the residual stream after each
block, so `act/<block>/rms` is the residual-stream RMS.

Under ``torch.compile`` the hook is traced into the model's graph (`ProbeContext.compiled_values`): sampled
statistics through the opaque op ``torch.ops.stabkit.tensor_stats`` (`stabkit.stats.opaque`: the eager
code, one graph output), statistics of every step as graph ops Inductor fuses.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ..distributed import is_dtensor, plain
from ..metric_names import ACT, metric
from ..stats.opaque import TENSOR_COMBINES, tensor_values
from ..stats.recorder import Reduction
from ..stats.tensor_batch import TensorReductions, by_device, finish_tensors, reduce_tensor
from .base import Probe, ProbeContext, first_tensor, guarded, reduce_plain, select_modules

TENSOR_REDUCTIONS: tuple[Reduction, ...] = ("rms", "max", "sum")
"""Cross-rank reductions of rms, abs-max and the non-finite count."""


class ActivationProbe(Probe):
    """Writes `act/<path>/rms`, `act/<path>/absmax`, `act/<path>/nonfinite` on sampled steps."""

    name = "act"
    families = frozenset({"act"})

    def attach(self, ctx: ProbeContext) -> None:
        super().attach(ctx)
        mm = ctx.model_map
        default: list[str] = []
        for b in mm.blocks:
            default += [b.path, *(a.path for a in b.attentions)] + ([b.mlp] if b.mlp else [])
        self.paths = select_modules(ctx.model, ctx.config.modules, list(dict.fromkeys(default)))
        # A module often returns its child's output object unchanged (attn -> o_proj, mlp -> proj):
        # the last measured tensor is remembered (weakly, so nothing is kept alive) and not measured twice.
        self._last: tuple[weakref.ref[torch.Tensor], TensorReductions] | None = None
        self._kept: list[tuple[tuple[str, str, str], TensorReductions]] = []
        """Reductions of this step's measured outputs, finished at the step's first read (`_finish`)."""
        modules = dict(ctx.model.named_modules())
        self.watch_forwards()
        for path in self.paths:
            self.handles.append(
                ctx.hooks.forward(self.name, modules[path], self._make_hook(path), cadence=ctx.config.every)
            )

    def _make_hook(self, path: str) -> Any:
        names = (metric(ACT, path, "rms"), metric(ACT, path, "absmax"), metric(ACT, path, "nonfinite"))

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            ctx = self.ctx
            assert ctx is not None
            if self.enabled and ctx.sampled() and ctx.training_forward(module):
                self._measure(names, output)

        return hook

    @guarded
    def _measure(self, names: tuple[str, str, str], output: Any) -> None:
        """Forward hook body (after the module's forward, in a sampled training forward)."""
        ctx = self.ctx
        assert ctx is not None
        x = first_tensor(output)
        if is_dtensor(x):  # tensor parallel (use_local_output=False): this rank's piece, no sum pending
            x = plain(x)
        if torch.compiler.is_compiling():  # every step: fused graph ops; sampled: one opaque op
            x = x.detach()
            values = ctx.compiled_values(
                lambda: tensor_values(x),
                lambda gate, every: torch.ops.stabkit.tensor_stats(x, gate, every),  # repeats are CSE'd
            )
            ctx.recorder.add_packed(names, TENSOR_COMBINES, TENSOR_REDUCTIONS, *values)
            return
        last = self._last
        if last is not None and last[0]() is x:
            kept = last[1]
        else:
            kept = reduce_plain(reduce_tensor, x)
            self._last = (weakref.ref(x), kept)
        self._kept.append((names, kept))
        ctx.recorder.defer(self._finish)

    @guarded
    def _finish(self) -> None:
        """Before the step's statistics are read (`Recorder.defer`): the statistics of every tensor
        the hooks reduced since, as three vectors per device."""
        ctx = self.ctx
        kept, self._kept = self._kept, []
        if ctx is None or not kept:
            return
        reductions = [r for _, r in kept]
        for idx in by_device(reductions).values():
            rms, absmax, nonfinite = finish_tensors([reductions[i] for i in idx])
            rec = ctx.recorder
            rec.add_vector(tuple(kept[i][0][0] for i in idx), rms, combine="rms", reduction="rms")
            rec.add_vector(tuple(kept[i][0][1] for i in idx), absmax, combine="max", reduction="max")
            rec.add_vector(tuple(kept[i][0][2] for i in idx), nonfinite, combine="sum", reduction="sum")
