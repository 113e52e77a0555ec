"""QK-Clip (Kimi K2, arXiv 2507.20534, §2.1 and App. D; Megatron-LM ``qk_clip_threshold`` 100,
``qk_clip_alpha`` 0.5): after each optimizer step, every head whose max pre-softmax logit over the
step's batch exceeded τ has its query and key weights scaled so that this max becomes τ.

For head h with ``S_h = max q·k·scale`` (signed, over every batch row, query and allowed key of the
step's training forwards) above τ, ``γ_h = τ / S_h`` and ``W_q ← γ^α W_q``, ``W_k ← γ^(1−α) W_k``
(α = 0.5), that head's rows only (`stabkit.interventions.qkclip_rows`: fused, interleaved, GQA —
the group's keys follow its largest max —, MLA's parts, ``nn.MultiheadAttention``; q/k biases and an
optimizer's fp32 master copies of those weights too; optimizer moments are left alone, as in
Megatron). It changes no forward code and does nothing until a head crosses τ: a head below τ keeps
its weights bit for bit. K2 ran τ = 100 and saw 12.7 % of heads clip at least once in the first 70k
steps, then none.

The max is exact (`stabkit.interventions.qkclip_max`): measured at every attention call of every
training forward in the intervention's own scope — a sampled statistic could miss the head it must
clip. `stabkit bench` shows what that costs.

Use::

    handle = stabkit.interventions.apply(model, "qk_clip", tau=100.0)
    handle.watch(optimizer)      # clip after each optimizer.step() (AdamW, torch.optim.Muon, a list)
    ...
    handle.remove()              # stops clipping (weights already clipped stay as they are)

``attach(model, optimizer, interventions=["qk_clip"])`` and the 'rescue' action watch the optimizer
for you. Metrics per attention module p (`Handle.metrics`, and recorded by the monitor):
``qk_clip/p/max_logit`` (the exact max of the step, before the clip), ``qk_clip/p/heads_clipped``,
``qk_clip/p/min_gamma``, ``qk_clip/p/ever_clipped`` (fraction of heads clipped at least once) and
``qk_clip/p/max_logit_clipped_heads`` (the max over heads clipped at an earlier step: how far past
τ a head gets between clips); over the model ``qk_clip/heads_clipped``, ``qk_clip/share_clipped``
(the share of heads clipped at this step), ``qk_clip/ever_clipped`` and
``qk_clip/max_logit_clipped_heads``.

When it runs: the scope in every forward of each attention module (measuring only in training
forwards: training mode, gradients on, not discovery's trace); the clip in the optimizer's step
post-hook (after the last optimizer of a list), under ``no_grad``, with no host sync. Under
``torch.distributed`` the per-head maxima are all-reduced (max) before the clip, so every rank
scales alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import kernels
from ..attention.call import QKCall
from ..attention.measure.eager import ROW_MAXES, SUBTRACTIONS, EagerTracker
from ..attention.measure.sites import INTERVENTION_CAP_ATTR, attention_shaped, model_cap, no_autocast
from ..attention.readers import Reader, read_mha, read_sdpa, read_softmax
from ..attention.scope import SDPA, SOFTMAXES, attach_scope
from ..discovery.modelmap import OPAQUE
from ..discovery.trace import tracing
from ..hooks import DIRECT, Registrar
from ..plugins import INTERVENTIONS
from ..tables import bounds
from .base import Intervention
from .common import keep_hook, model_map
from .handle import Handle, InterventionError
from .qkclip_max import head_max
from .qkclip_rows import NAME, ClipPlan, RowTarget, plan_for

if TYPE_CHECKING:
    from ..discovery.trace import Trace

MASTER_KEYS = ("master_param", "main_param", "fp32_param", "master_weight", "master_weights")
"""Optimizer-state keys (and parameter attributes ``main_param`` / ``master_param``) under which an
optimizer keeps a higher-precision master copy of a parameter; a clip scales it like the parameter."""

Record = Callable[[str, torch.Tensor], None]


@dataclass(frozen=True)
class QKClipOptions:
    """The options of ``qk_clip``."""

    tau: float = field(default=100.0, metadata=bounds(lo=0.0, lo_open=True))
    """Threshold τ on a head's max attention logit (K2 and Megatron: 100; K2's 3B ablation: 30)."""
    alpha: float = field(default=0.5, metadata=bounds(lo=0.0, hi=1.0))
    """Share of the clip on the queries: W_q ← γ^α W_q, W_k ← γ^(1−α) W_k (K2: 0.5)."""
    chunk_bytes: int = field(default=1 << 22, metadata=bounds(lo=1))
    """Temporary memory of the exact max, in bytes (blocks of rows × heads × queries × keys)."""


class _Site:
    """One attention module: its plan, the step's running max and the clip's history."""

    def __init__(self, plan: ClipPlan, module: nn.Module) -> None:
        self.plan = plan
        self.module = module
        self.top: torch.Tensor | None = None
        """(H,) the running max logit of the step's training forwards (None: none yet)."""
        self.ever: torch.Tensor | None = None
        """(H,) bool: heads clipped at least once."""
        self._index: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._kv: dict[torch.device, torch.Tensor] = {}

    def index(self, target: RowTarget) -> torch.Tensor:
        device = target.param.device
        key = (target.name, device)
        if key not in self._index:
            self._index[key] = torch.tensor(target.slots, dtype=torch.long, device=device)
        return self._index[key]

    def add(self, top: torch.Tensor) -> None:
        top = top.detach().float()
        self.top = top.clone() if self.top is None else torch.maximum(self.top, top)


class QKClipHandle(Handle):
    """The handle of ``qk_clip``: `watch` an optimizer (clip after each step) or call `clip` yourself;
    `remove` stops measuring and clipping."""

    def __init__(self, model: nn.Module, options: QKClipOptions) -> None:
        super().__init__(model, [NAME])
        self.options = options
        self.sites: dict[str, _Site] = {}
        self.clips = 0
        """Clips run so far (optimizer steps since `watch`)."""
        self._latest: dict[str, torch.Tensor] = {}
        self._record: Record | None = None
        self._watch: list[Any] = []
        self.set_metrics(lambda: dict(self._latest))

    # ------------------------------------------------------------------ the optimizer
    def watch(self, optimizer: Any, record: Record | None = None, hooks: Registrar = DIRECT) -> None:
        """Clip after every ``optimizer.step()`` (a step post-hook; a list or `OptimizerSet` of
        optimizers: after the last one). `record(name, value)` also gets the metrics of each clip
        (the 'rescue' action passes the monitor's recorder). Replaces an earlier `watch`."""
        self.unwatch()
        self._record = record
        self._optimizer = optimizer
        last = optimizer[-1] if isinstance(optimizer, list | tuple) else optimizer  # stepped last
        self._watch = [hooks.step_post(NAME, last, lambda opt, args, kwargs: self.clip())]

    def unwatch(self) -> None:
        """Stop clipping after optimizer steps (safe twice)."""
        while self._watch:
            self._watch.pop().remove()

    # ------------------------------------------------------------------ the clip
    @torch.no_grad()
    def clip(self) -> None:
        """Clip every head whose max logit since the last clip exceeded τ (see the module docstring);
        then start the next step's max. Call after the optimizer step."""
        if self.removed:
            return
        sites = [s for s in self.sites.values() if s.top is not None]
        _all_reduce_max(sites)
        tau, alpha = self.options.tau, self.options.alpha
        optimizer = getattr(self, "_optimizer", None)
        latest: dict[str, torch.Tensor] = {}
        clipped: list[torch.Tensor] = []
        ever: list[torch.Tensor] = []
        after: list[torch.Tensor] = []
        for site in sites:
            top = site.top
            assert top is not None
            over = torch.isfinite(top) & (top > tau)
            gamma = torch.where(over, tau / top, torch.ones_like(top))  # (H,)
            table = site.plan.table(gamma, alpha)
            for target in site.plan.targets.values():
                _scale(target, table.index_select(0, site.index(target)), optimizer)
            before = site.ever if site.ever is not None else torch.zeros_like(over)
            seen = torch.where(before & torch.isfinite(top), top, torch.zeros_like(top))
            site.ever = before | over
            p = site.plan.path
            latest[f"qk_clip/{p}/max_logit"] = top.amax()
            latest[f"qk_clip/{p}/heads_clipped"] = over.sum().float()
            latest[f"qk_clip/{p}/min_gamma"] = gamma.amin()
            latest[f"qk_clip/{p}/ever_clipped"] = site.ever.float().mean()
            latest[f"qk_clip/{p}/max_logit_clipped_heads"] = seen.amax()
            clipped.append(over.sum().float())
            ever.append(site.ever.float())
            after.append(seen.amax())
            site.top = None
        if sites:
            latest["qk_clip/heads_clipped"] = torch.stack(clipped).sum()
            latest["qk_clip/share_clipped"] = latest["qk_clip/heads_clipped"] / sum(
                s.plan.n_heads for s in sites
            )
            latest["qk_clip/ever_clipped"] = torch.cat(ever).mean()
            latest["qk_clip/max_logit_clipped_heads"] = torch.stack(after).amax()
        self.clips += 1
        self._latest = latest
        if self._record is not None:
            for name, value in latest.items():
                self._record(name, value)

    def remove(self) -> None:
        self.unwatch()
        super().remove()


def _scale(target: RowTarget, factors: torch.Tensor, optimizer: Any) -> None:
    """Multiply the rows of `target` by `factors` (one per row; 1 leaves a row bit for bit), and the
    optimizer's master copy of it, where it keeps one."""
    param = target.param
    shape = [1] * param.dim()
    shape[target.axis] = -1
    param.mul_(factors.to(param.dtype).view(shape))
    for master in _masters(param, optimizer):
        master.mul_(factors.to(master.dtype).view(shape))


def _masters(param: torch.Tensor, optimizer: Any) -> list[torch.Tensor]:
    out = [
        t
        for attr in ("main_param", "master_param")
        if isinstance(t := getattr(param, attr, None), torch.Tensor) and t is not param
    ]
    for opt in optimizer if isinstance(optimizer, list | tuple) else [optimizer]:
        state = getattr(opt, "state", None)
        if state is None or param not in state:
            continue
        entry = state[param]
        for key in MASTER_KEYS:
            value = entry.get(key) if isinstance(entry, dict) else None
            if isinstance(value, torch.Tensor) and value.shape == param.shape and value is not param:
                out.append(value)
    return out


def _all_reduce_max(sites: list[_Site]) -> None:
    """Under torch.distributed: every rank's per-head maxima combined (one collective)."""
    import torch.distributed as dist

    if not sites or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return
    flat = torch.cat([s.top for s in sites if s.top is not None])
    dist.all_reduce(flat, op=dist.ReduceOp.MAX)
    start = 0
    for s in sites:
        assert s.top is not None
        n = s.top.numel()
        s.top = flat[start : start + n]
        start += n


class _Measure:
    """The scope's handlers: the exact per-head max of each call (`qkclip_max.head_max`)."""

    def __init__(self, handle: QKClipHandle, tracked: dict[str, int]) -> None:
        self.handle = handle
        self.eager = EagerTracker(tracked)
        self._kernels: dict[str, Callable[..., Any]] = {}

    def functions(self, tracked: bool) -> dict[Callable[..., Any], Callable[..., Any]]:
        out: dict[Callable[..., Any], Callable[..., Any]] = {
            SDPA: self.handler(read_sdpa),
            F.multi_head_attention_forward: self.handler(read_mha),
        }
        out.update(dict.fromkeys(SOFTMAXES, self.handler(read_softmax, eager=True)))
        if tracked:
            out.update(dict.fromkeys(ROW_MAXES, self.eager.on_row_max))
            out.update(dict.fromkeys(SUBTRACTIONS, self.eager.on_sub))
        return out

    def kernel(self, func: Any) -> Callable[..., Any] | None:
        kernel = kernels.lookup(func)
        if kernel is None:
            return None
        if kernel.name not in self._kernels:
            self._kernels[kernel.name] = self.handler(read_sdpa, kernel=kernel)
        return self._kernels[kernel.name]

    def handler(self, reader: Reader, eager: bool = False, kernel: Any = None) -> Callable[..., Any]:
        def handle_call(
            path: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> Any:
            site = self.handle.sites.get(path)
            if site is not None and not (eager and not attention_shaped(args, kwargs)):
                self.handle.count(path)
                if site.module.training and torch.is_grad_enabled() and not tracing():
                    self._measure(site, path, reader, func, args, kwargs, eager, kernel)
            return func(*args, **kwargs)

        return handle_call

    def _measure(
        self,
        site: _Site,
        path: str,
        reader: Reader,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        eager: bool,
        kernel: Any,
    ) -> None:
        with torch._C.DisableTorchFunction(), torch.no_grad(), no_autocast(args, kwargs):
            if eager and path in self.eager.sink_columns:
                call: Any = self.eager.read(path, args, kwargs)
            elif kernel is not None:
                call = kernels.read_call(kernel, func, args, kwargs)
            else:
                call = reader(args, kwargs)
            cap = None
            if not isinstance(
                call, QKCall
            ):  # an eager softmax input: capped already, by the model or attn_softcap
                cap = model_cap(site.module) or _positive(getattr(site.module, INTERVENTION_CAP_ATTR, None))
            top = head_max(call, self.handle.options.chunk_bytes, cap)
        if top.shape[0] != site.plan.n_heads:
            raise InterventionError(
                NAME,
                path,
                f"its attention call has {top.shape[0]} heads, discovery found {site.plan.n_heads}",
            )
        site.add(top)

    def end(self, path: str, handled: int, output: Any) -> None:
        self.eager.end(path)


def _positive(value: Any) -> float | None:
    return (
        float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value > 0 else None
    )


def apply_qk_clip(model: nn.Module, options: QKClipOptions, model_map_override: Any = None) -> QKClipHandle:
    """Plan the clip of every attention module and install the exact-max scope (see the module
    docstring); the clip itself runs after optimizer steps once the handle `watch`es an optimizer."""
    mmap = model_map(model, NAME, model_map_override)
    handle = QKClipHandle(model, options)
    try:
        by_path: dict[str, list[Any]] = {}
        for a in mmap.attentions:
            by_path.setdefault(a.path, []).append(a)
        if not by_path:
            raise InterventionError(NAME, type(model).__name__, "no attention module found")
        for path, found in by_path.items():
            if len(found) > 1:
                raise InterventionError(
                    NAME, path, f"it makes {len(found)} attention calls; QK-Clip measures one per module"
                )
            a = found[0]
            if a.impl == OPAQUE:
                raise InterventionError(NAME, path, "its attention runs in a kernel stabkit cannot read")
            handle.sites[path] = _Site(plan_for(model, a), model.get_submodule(path) if path else model)
        tracked = {a.path: a.sink_columns for a in mmap.attentions if a.softmax_shift or a.sink_columns}
        measure = _Measure(handle, tracked)
        for path in handle.sites:
            scope = attach_scope(
                model,
                [path],
                measure.functions(path in tracked),
                outer=False,
                on_exit=measure.end,
                owner=NAME,
                resolve=measure.kernel,
            )
            keep_hook(handle, scope)
        keep_hook(handle, kernels.install((model,)))
    except BaseException:
        handle.remove()
        raise
    return handle


@INTERVENTIONS.register
class QKClipIntervention(Intervention):
    """``qk_clip`` (attention, acting on the weights: before qk_norm). The rescue's first choice for
    attention-logit growth: it changes nothing at the switch and acts only on heads past τ."""

    name = NAME
    order = 25
    description = "QK-Clip (Kimi K2): after each optimizer step, scale W_q, W_k of every head whose max logit passed tau back to tau"
    options_class = QKClipOptions
    midrun = True
    midrun_preference = 5

    def apply(self, model: nn.Module, model_map: Any, options: QKClipOptions) -> Handle:
        return apply_qk_clip(model, options, model_map)

    def verify(self, trace: Trace, model: nn.Module, handle: Handle) -> None:
        sites = getattr(handle, "sites", {})
        for path in sites:
            if handle.counts.get(path, 0) == 0:
                raise InterventionError(
                    NAME, path, "not in effect: its forward made no attention call stabkit could read"
                )

    def attach_optimizer(
        self, handle: Handle, optimizer: Any, record: Record | None = None, hooks: Registrar | None = None
    ) -> None:
        if isinstance(handle, QKClipHandle):
            handle.watch(optimizer, record, hooks or DIRECT)
