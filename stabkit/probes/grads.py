"""Gradient, parameter-norm and update-ratio probe.

When it runs:
- at the end of each backward pass (a callback queued by the first post-accumulate-grad hook
  that fires): one `_foreach_norm` over every gradient, kept on the device. After the last
  micro-batch this is the norm of the full (accumulated) gradient *before* any clipping the
  user does later;
- in the optimizer's step pre-hook (or at `Monitor.step` without an optimizer): the global
  norm every step; per-unit and per-group norms on sampled steps; parameter norms and (for update
  ratios) a snapshot of the parameters on the steps of the whole-model statistics
  (`MonitorConfig.deep_every`, every 5th sampled step by default). With ``optimizer.step(closure)`` (Lightning, LBFGS)
  the gradients are made inside ``step``: the pre-hook then runs after the closure's first call
  (`stabkit.hooks.AfterClosure`), so the norms are those of the closure's gradients (accumulated
  onto earlier micro-batches' when the closure does not zero them);
- in the optimizer's step post-hook: ‖θ_new − θ_old‖ / ‖θ_old‖ per unit on those steps, and the
  update norm ‖θ_new − θ_old‖ itself per unit and in all (Marin 32B: Adam update-norm spikes came
  before loss and gradient-norm spikes), with
  ‖Δθ‖ rebuilt from the optimizer state for Adam/AdamW/SGD (`updates.py`), so no copy of the
  parameters is kept; other optimizers get a snapshot on sampled steps.

A *unit* is a block (its path) or, outside the blocks, the module that owns the parameter.

Under torch.distributed (`stabkit.distributed`) norms are taken on each rank's own piece of a
tensor (`to_local()` of an FSDP2 or tensor-parallel DTensor), scaled so that the 'l2' reduction
across ranks gives the norm of the whole tensor (a replicated piece counts once). A DTensor gradient
is first laid out as its parameter (`like_param`: a SequenceParallel norm weight's Partial gradient
is summed over the TP ranks, one small collective per such parameter at the end of backward). The
end-of-backward callback queues itself once more, so it runs after DDP's own callback has written
the averaged gradients. Under FSDP2 update ratios are logged as numerator and denominator ('.num', '.den'), divided
after the reduction.
"""

from __future__ import annotations

from functools import partial
from operator import attrgetter, is_, itemgetter
from typing import Any, NamedTuple

import torch
from torch import nn

from ..distributed import DistContext, is_dtensor, like_param, local
from ..metric_names import GRAD, PARAM, UPDATE, metric
from ..stats import foreach_norm_f32, l2_of_norms
from ..stats.step_facts import FiniteSeen
from .base import Probe, ProbeContext, guarded
from .unit_norms import UnitNorms
from .updates import closed_form_supported, update_norms


def parameter_units(model: nn.Module, block_of: Any) -> tuple[list[str], list[nn.Parameter], list[str]]:
    """(names, parameters, unit of each) for the trainable parameters of `model` (tied ones once)."""
    names, params, units = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        names.append(name)
        params.append(p)
        units.append(block_of(name) or (name.rsplit(".", 1)[0] if "." in name else name))
    return names, params, units


_REQUIRES_GRAD = attrgetter("requires_grad")
_GRAD = attrgetter("grad")
_IS_NONE = partial(is_, None)
"""C-level tests of a list's entries (no Python frame per parameter on the every-step path; never
``None in grads``, which compares every tensor with ``==``)."""
_PARAMS = itemgetter("params")


class GradNorms(NamedTuple):
    """The gradient norms of one backward: float32 0-d device tensors, one per parameter in
    `present` (positions in `GradProbe.params`; None: every parameter, the usual step)."""

    present: list[int] | None
    norms: list[torch.Tensor]


class GradProbe(Probe):
    """Writes grad/global_norm, grad/<unit>/norm, grad/param_group.<i>/norm, param/<unit>/norm,
    update/<unit>/ratio, update/global_ratio, update/<unit>/norm and update/norm."""

    name = "grad"
    families = frozenset({"grad", "param", "update"})

    def attach(self, ctx: ProbeContext) -> None:
        super().attach(ctx)
        self._param_handles: list[Any] = []
        self._setup(ctx)
        if ctx.optimizer is not None:
            self.handles.append(ctx.hooks.step_pre(self.name, ctx.optimizer, self._pre_step))
            self.handles.append(ctx.hooks.step_post(self.name, ctx.optimizer, self._post_step))

    def detach(self) -> None:
        """Remove the hooks (safe twice)."""
        for h in getattr(self, "_param_handles", []):
            h.remove()
        self._param_handles = []
        super().detach()

    def _groups(self, ctx: ProbeContext) -> tuple[int, ...]:
        """The sizes of the optimizer's param groups (a parameter new to the model is seen when it
        joins the optimizer: ``add_param_group``, or a group's list grows)."""
        return () if ctx.optimizer is None else tuple(map(len, map(_PARAMS, ctx.optimizer.param_groups)))

    def _layout_changed(self, ctx: ProbeContext) -> bool:
        """Whether the parameter lists must be made again: a parameter frozen at `_setup` trains now,
        or the optimizer's groups changed. Runs every step, so it reads only the frozen parameters'
        flags (usually none) and the groups' sizes — reading all of the model's ``requires_grad``
        right after a step's kernels cost ~1 µs a parameter in cache misses. A trainable parameter
        frozen since is seen when its gradient goes missing (`_after_backward`). Asked once a step:
        at the end of backward, or at `end_step` when no backward gave this probe a gradient."""
        return any(map(_REQUIRES_GRAD, self._frozen)) or self._groups(ctx) != self._group_sizes

    def _setup(self, ctx: ProbeContext) -> None:
        """Parameter lists, units, groups and per-parameter gradient hooks (at attach, and again when
        parameters are unfrozen or a param group is added)."""
        for h in self._param_handles:
            h.remove()
        self._param_handles = []
        self._frozen = [p for p in ctx.model.parameters() if not p.requires_grad]
        self._group_sizes = self._groups(ctx)
        fam = ctx.config.families
        self.want_grad = "grad" in fam
        self.want_param = "param" in fam
        self.want_update = "update" in fam and ctx.optimizer is not None
        self.names, self.params, units = parameter_units(ctx.model, ctx.model_map.block_of)
        self.unit_names = list(dict.fromkeys(units))
        # names built once per layout, not per sampled step
        self.unit_metric = {
            (family, stat): [metric(family, u, stat) for u in self.unit_names]
            for family, stat in ((PARAM, "norm"), (GRAD, "norm"), (UPDATE, "ratio"), (UPDATE, "norm"))
        }
        self.unit_index = [self.unit_names.index(u) for u in units]
        self.group_of: list[int] = [-1] * len(self.params)
        if ctx.optimizer is not None:
            where = {id(p): i for i, p in enumerate(self.params)}
            for g, group in enumerate(ctx.optimizer.param_groups):
                for p in group["params"]:
                    if id(p) in where:
                        self.group_of[where[id(p)]] = g
        self._grad_norms: GradNorms | None = None
        """This step's per-parameter gradient norms (the newest backward's), None before one."""
        self.scaler = ctx.facts.scaler
        self._stepped = False
        self.skipped = False
        """True after `end_step` when gradients arrived but the optimizer did not step (e.g. GradScaler overflow)."""
        self._snapshot: list[torch.Tensor] | None = None
        self._snapshot_idx: list[int] | None = None
        self._old_norms: list[torch.Tensor] = []
        self.closed_form = ctx.optimizer is not None and closed_form_supported(ctx.optimizer)
        self._queued = False
        self.dist: DistContext = ctx.facts.dist
        self.scales = self.dist.norm_scales(self.params)
        self._dtensors = any(is_dtensor(p) for p in self.params)
        """Some parameter is a DTensor: gradients are taken as this rank's piece (`local`)."""
        self.unit_norms = UnitNorms.of(
            self.unit_index, len(self.unit_names), [local(p.detach()).device for p in self.params]
        )
        if self.want_grad:
            for p in self.params:
                self._param_handles.append(
                    ctx.hooks.grad_accumulated(self.name, p, self._on_grad_accumulated)
                )

    def _on_grad_accumulated(self, param: torch.Tensor) -> None:
        """Per parameter, during backward: queue one end-of-backward callback (cheap flag check)."""
        if not self._queued and self.enabled:
            self._queued = True
            # distributed: queue once more from the callback, so the norms follow DDP's own
            # end-of-backward callback (queued later during backward) that writes the averages
            first = self._requeue if self.dist.active else self._after_backward
            torch.autograd.Variable._execution_engine.queue_callback(first)

    def _requeue(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    @guarded
    def _after_backward(self) -> None:
        """End of a backward pass: the norm of every gradient so far, in one fused call. Gradients
        only accumulate within a step, so the newest backward's norms replace the earlier ones."""
        self._queued = False
        ctx = self.ctx
        if ctx is not None and self._layout_changed(ctx):  # unfrozen since: follow them
            self._setup(ctx)
        grads = list(map(_GRAD, self.params))
        present: list[int] | None = None  # None: every parameter has a gradient (the usual step)
        if any(map(_IS_NONE, grads)):
            if ctx is not None and not all(map(_REQUIRES_GRAD, self.params)):
                self._setup(ctx)  # frozen since the lists were made: they no longer hold it
                grads = list(map(_GRAD, self.params))
            present = [i for i, g in enumerate(grads) if g is not None]
            grads = [grads[i] for i in present]
        if not grads:
            return
        if self.dist.sharded:  # a DTensor gradient in its parameter's layout (Partial: a collective)
            grads = [
                like_param(g, self.params[i]) for i, g in zip(self._indices(present), grads, strict=True)
            ]
        if self._dtensors:
            grads = [local(g) for g in grads]
        norms = foreach_norm_f32(grads)
        if self.dist.active:
            norms = self._scaled(self._indices(present), norms)
        self._grad_norms = GradNorms(present, norms)

    def _indices(self, present: list[int] | None) -> list[int]:
        """Positions of the parameters `present` names (None: all of them)."""
        return list(range(len(self.params))) if present is None else present

    def _scaled(self, idx: list[int], norms: Any) -> list[torch.Tensor]:
        """Local norms times each parameter's cross-rank scale (unchanged when not distributed)."""
        if not self.dist.active:
            return list(norms)
        return [n * self.scales[i] for i, n in zip(idx, norms, strict=True)]

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.before_update()

    @guarded
    def before_update(self) -> None:
        """Grad norms (every step), per-unit and per-group ones on sampled steps, and on the steps of
        the whole-model statistics (`MonitorConfig.deep_every`) parameter norms and what the update
        norms need (the norms before the update; a snapshot for an optimizer without a closed form)."""
        ctx = self.ctx
        assert ctx is not None
        self._stepped = True
        sampled = ctx.sampled()
        if self.want_grad:
            self._record_grads(sampled)
        if sampled and (self.want_param or self.want_update) and ctx.deep():
            with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
            tensors = [local(self.params[i]) for i in with_grad]  # under no_grad (`guarded`)
            norms = foreach_norm_f32(tensors) if tensors else []
            norms = self._scaled(with_grad, norms)
            if self.want_param:
                for u, value in self._per_unit(with_grad, norms):
                    ctx.recorder.add(self.unit_metric[PARAM, "norm"][u], value, reduction="l2")
            if self.want_update:
                self._snapshot = None if self.closed_form else [t.clone() for t in tensors]
                self._snapshot_idx = with_grad
                self._old_norms = norms

    def _record_grads(self, sampled: bool) -> None:
        ctx = self.ctx
        assert ctx is not None
        seen = self._grad_norms
        if seen is None:
            return
        rec = ctx.recorder
        # with a GradScaler the norms were taken on scaled gradients; its scale is unchanged until update()
        unscale = None if self.scaler is None else 1.0 / self.scaler._scale.reshape(()).float()

        def combined(norms: list[torch.Tensor]) -> torch.Tensor:  # float32 0-d each, never empty
            total = torch.linalg.vector_norm(torch.stack(norms))
            return total if unscale is None else total * unscale

        rec.add("grad/global_norm", combined(seen.norms), reduction="l2")
        if not sampled:
            return
        idx = self._indices(seen.present)
        for u, value in self._per_unit(idx, seen.norms):
            rec.add(
                self.unit_metric[GRAD, "norm"][u],
                value if unscale is None else value * unscale,
                reduction="l2",
            )
        for g in sorted({self.group_of[i] for i in idx if self.group_of[i] >= 0}):
            sub = [n for i, n in zip(idx, seen.norms, strict=True) if self.group_of[i] == g]
            rec.add(f"grad/param_group.{g}/norm", combined(sub), reduction="l2")

    def _post_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._stepped:  # attached during this step: its pre-hook had already run
            self.late_grads()
        if self.want_update:
            self.after_update()

    @guarded
    def late_grads(self) -> None:
        """The gradient norms of a step whose pre-hook did not run because the monitor attached
        during ``optimizer.step(closure)`` (discovery at the first forward, inside the closure:
        Lightning's first step). Exact: the norms were taken at the end of backward, before the
        update; that one step has no parameter norms or update ratios."""
        self._stepped = True
        if self.want_grad:
            self._record_grads(self.ctx.sampled())  # type: ignore[union-attr]

    @guarded
    def after_update(self) -> None:
        """‖Δθ‖/‖θ_old‖ per unit from the snapshot taken before the update (sampled steps)."""
        ctx = self.ctx
        assert ctx is not None
        idx = self._snapshot_idx
        if idx is None:
            return
        self._snapshot_idx = None
        current = [self.params[i] for i in idx]
        if self._snapshot is None:
            assert ctx.optimizer is not None
            seen = FiniteSeen()
            deltas = update_norms(ctx.optimizer, current, seen)
            ctx.facts.leave_after_update(ctx.step(), seen)  # the non-finite check reads the rest
        else:
            snap, self._snapshot = self._snapshot, None
            torch._foreach_sub_(snap, [local(p.detach()) for p in current])  # snap := θ_old − θ_new
            deltas = foreach_norm_f32(snap)
            del snap
        deltas = self._scaled(idx, deltas)
        old = dict(self._per_unit(idx, self._old_norms))
        for u, delta in self._per_unit(idx, deltas):
            self._record_ratio(self.unit_metric[UPDATE, "ratio"][u], delta, old[u])
            ctx.recorder.add(self.unit_metric[UPDATE, "norm"][u], delta, reduction="l2")
        total = l2_of_norms(deltas)
        self._record_ratio("update/global_ratio", total, l2_of_norms(self._old_norms))
        ctx.recorder.add("update/norm", total, reduction="l2")

    def _per_unit(self, idx: list[int], norms: list[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
        """(unit, 0-d L2 of its parameters' norms) for the units of parameters `idx`: one ``index_add_``
        (`UnitNorms`), or unit by unit when the norms are on several devices."""
        squares = self.unit_norms.squares(idx, norms)
        units = self.unit_norms.units(idx)
        if squares is not None:
            roots = squares.sqrt()
            return [(u, roots[u]) for u in units]
        out = []
        for u in units:
            out.append(
                (u, l2_of_norms([n for i, n in zip(idx, norms, strict=True) if self.unit_index[i] == u]))
            )
        return out

    def _record_ratio(self, name: str, delta: torch.Tensor, old: torch.Tensor) -> None:
        """‖Δθ‖/‖θ_old‖; under FSDP2 both parts, each an 'l2' of shards, divided after the reduction."""
        rec = self.ctx.recorder  # type: ignore[union-attr]
        if self.dist.mode == "sharded":
            rec.add(name + ".num", delta, reduction="l2")
            rec.add(name + ".den", old, reduction="l2")
        else:
            rec.add(name, delta / old.clamp_min(1e-12), reduction="max")

    def _record_amp(self, ctx: ProbeContext) -> None:
        """With an enabled fp16 GradScaler: ``amp/scale`` (after its update) and ``amp/overflow`` (1
        when it skipped this step's update)."""
        scaler = ctx.facts.scaler
        if scaler is None or not ctx.facts.scaled:
            return
        if scaler._scale is not None:
            ctx.recorder.add("amp/scale", scaler._scale.clone())  # update() changes it in place
        ctx.recorder.add("amp/overflow", torch.tensor(float(self.skipped)))

    def end_step(self) -> None:
        """At `Monitor.step`: without an optimizer, take grad stats now; then forget this step's norms."""
        ctx = self.ctx
        assert ctx is not None
        if ctx.optimizer is None:
            self.before_update()
        had_grads = self._grad_norms is not None
        self.skipped = ctx.optimizer is not None and had_grads and not self._stepped
        ctx.facts.update_skipped = self.skipped
        self._stepped = False
        self._record_amp(ctx)
        self._queued = False  # a backward that raised never ran its callback
        self._grad_norms = None
        # unfrozen parameters, a new param group: the end of backward looked already when it ran
        # (a change made since is seen by the next one, before it takes any norm)
        if not had_grads and self._layout_changed(ctx):
            self._setup(ctx)
