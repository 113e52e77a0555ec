"""Attention probe: max |pre-softmax logit| and attention entropy per attention layer, for any
attention implementation (fused SDPA included).

How it sees the logits: on sampled steps (``MonitorConfig.attention_every``), a scoped
``TorchFunctionMode`` (`stabkit.attention.attach_scope`, innermost) is pushed in each attention
module's forward pre-hook and popped in its forward hook. While the module runs, the mode routes
``F.scaled_dot_product_attention``, the softmaxes of eager attention,
``F.multi_head_attention_forward`` and the calls of known attention kernels (flash-attn 2/3,
FlexAttention, xformers, Transformer Engine, aten SDPA ops, kernels registered with
`stabkit.register_kernel`: `stabkit.attention.kernels`) to this probe, which reads q and k from the
call's arguments (honouring its causal flag, window, chunks, packed documents, ALiBi, soft cap, sinks,
block mask and score_mod) and recomputes the logits on a sample of batch
rows and query positions (`MonitorConfig.attn_sample_rows` / `attn_sample_queries`; None = exact;
see `stabkit.attention.measure.measure` for how the max is kept close to exact), in float32 under ``no_grad``, with
no RNG, in blocks of heads, queries and keys whose temporaries stay within
`MonitorConfig.attn_chunk_bytes` (the entropy by an online log-sum-exp over key blocks), then
passes the call on with its original arguments: the model's outputs and RNG stream are untouched.
On other steps, and in forwards that are not training forwards (evaluation, ``generate()``,
``no_grad``, checkpoint recomputation: `ProbeContext.training_forward`), the pre-hook returns at
once (no mode). An attention module whose training-mode forward makes none of these calls (an
unregistered custom kernel), or a call the probe cannot read, is named in one warning and no longer
watched; the other modules and every other statistic go on (``MonitorConfig(strict=True)`` raises
instead). Sites discovery already found opaque (impl ``"opaque"``: it warned at attach) are not watched.

Metrics per attention module (path `p`): ``attn/p/max_logit`` (combine max), ``attn/p/entropy``
(mean), ``attn/p/min_head_entropy`` (min over micro-batches), with
``MonitorConfig.attn_per_head`` also ``attn/p/head.<h>/max_logit`` and ``.../head.<h>/entropy``.
Attention sinks (on the uniform sample): ``attn/p/first_key_mass``, the largest per-head mean
softmax probability on the first key, and ``attn/p/sink_heads``, the fraction of heads whose mass
exceeds 0.3 (Gu et al., ICLR 2025; per head ``attn/p/head.<h>/first_key_mass``).
With learned sink logits (GPT-OSS eager, kernels given ``sinks``), ``attn/p/sink_mass``: the mean
softmax probability on the sinks (per head: ``attn/p/head.<h>/sink_mass``); the sinks enter the
entropy but not the max logit, and their mass is the one ``first_key_mass`` / ``sink_heads`` read.
A softmax whose input the model shifted by its row max is read
unshifted (`stabkit.attention.measure.eager`).
With a soft cap, also ``attn/p/max_logit_capped``:

- cap set by the ``attn_softcap`` intervention (attribute ``_stabkit_attn_softcap``): the probe sees
  the raw call, so ``max_logit`` is the raw value, ``max_logit_capped = cap·tanh(max_logit/cap)``
  (exact: tanh is monotone), and the entropy is that of the capped distribution;
- cap computed before an eager softmax, by the model itself (reference GPT ``attn_softcap``,
  ``module.softcap``; HF ``attn_logit_softcapping``) or by ``attn_softcap`` on eager attention (it caps
  before the bias): only the capped logits are visible, so
  ``max_logit_capped`` is measured and ``max_logit`` is recovered by inverting the cap (exact up to
  float32 rounding while |logit| < ~8·cap, a lower bound beyond).

On the softmax path the logit includes any additive bias the model adds before the softmax (zero
for ordinary masks); on the SDPA path an additive ``attn_mask`` enters the entropy, not max_logit.

Limits: ``nn.MultiheadAttention`` that may take its fused inference path (eval and no gradient
needed, e.g. a frozen sub-module in a training forward) is not measured — a mode would divert it
from its fused path; ``nn.TransformerEncoderLayer`` refuses its own fused inference path
whenever a module hook is attached (any monitor hook, not only this probe's). Single-token HF
decoding with GQA packs query heads into the query dim, so per-head values there are per kv head.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import kernels
from ..attention.call import LogitsCall, QKCall
from ..attention.measure.eager import ROW_MAXES, SUBTRACTIONS, EagerTracker
from ..attention.measure.measure import measure
from ..attention.measure.op import layout, measured, opaque_ok, summary_values
from ..attention.measure.sites import (
    INTERVENTION_CAP_ATTR,
    attention_shaped,
    model_cap,
    no_autocast,
    positive_number,
)
from ..attention.measure.stats import HeadStats, Sampling, uncap
from ..attention.readers import Reader, read_mha, read_sdpa, read_softmax
from ..attention.scope import SDPA, SOFTMAXES, ScopeHandle, attach_scope
from ..discovery.modelmap import OPAQUE
from ..hooks import hook_warning
from ..metric_names import ATTN, metric
from .base import Probe, ProbeContext, ProbeError, guarded
from .split_exact import head_offset, record_head_parts


class AttentionProbe(Probe):
    """Writes `attn/<path>/{max_logit,entropy,min_head_entropy}` (and per head / capped / sink mass)
    on sampled steps."""

    name = "attn"
    families = frozenset({"attn"})

    def attach(self, ctx: ProbeContext) -> None:
        super().attach(ctx)
        sites = {a.path: a for a in ctx.model_map.attentions if a.path and a.impl != OPAQUE}
        self.modules: dict[str, nn.Module] = {p: ctx.model.get_submodule(p) for p in sites}
        self._inline = set(ctx.model_map.block_paths) & set(self.modules)
        """Blocks that compute attention inline: only their attention-shaped softmaxes are read."""
        self._off: set[str] = set()
        """Attention modules whose calls cannot be read: warned about once, no longer watched."""
        self._reads: dict[str, int] = {}
        """Calls read (or tried) in each module's forward in progress."""
        self._kept: list[tuple[str, HeadStats, float | None, float | None]] = []
        """This step's measured calls, summarised at the step's first read (`_finish`)."""
        tracked = {p: a.sink_columns for p, a in sites.items() if a.softmax_shift or a.sink_columns}
        self._eager = EagerTracker(tracked)
        readers: dict[Callable[..., Any], Reader] = {
            SDPA: read_sdpa,
            F.multi_head_attention_forward: read_mha,
        }
        functions = {fn: self._make_handler(reader) for fn, reader in readers.items()}
        functions.update(dict.fromkeys(SOFTMAXES, self._make_handler(read_softmax, eager=True)))
        tracking = dict(functions)
        tracking.update(dict.fromkeys(ROW_MAXES, self._eager.on_row_max))
        tracking.update(dict.fromkeys(SUBTRACTIONS, self._eager.on_sub))
        self._kernel_handlers: dict[str, Callable[..., Any]] = {}
        self._split = ctx.facts.dist.world_size > 1
        """Several ranks: per-head parts are recorded too, for statistics exact across them (`split_exact`)."""
        self._heads: dict[str, tuple[int, int] | None] = {}
        """path -> (global heads, this rank's first head), None when they cannot be told."""
        self._entry_points = kernels.install((ctx.model,))  # Python-level kernels visible to the scope's mode
        every = ctx.config.attention_every
        self.watch_forwards()
        self._scopes: list[ScopeHandle] = []
        for path, module in self.modules.items():

            def sampled(m: nn.Module = module, p: str = path) -> bool:
                """In the module's forward pre-hook: push the mode only in sampled training forwards."""
                if p in self._off or not (self.enabled and ctx.sampled(every) and ctx.training_forward(m)):
                    return False
                if isinstance(m, nn.MultiheadAttention) and _mha_fast_path_possible(m):
                    return False
                self._reads[p] = 0
                return True

            scope = attach_scope(
                ctx.model,
                [path],
                tracking if path in tracked else functions,
                outer=False,
                on_exit=self._on_exit,
                enabled=sampled,
                hooks=ctx.hooks,
                owner=self.name,
                resolve=self._kernel_handler,
                cadence=every,
            )
            self._scopes.append(scope)

    def detach(self) -> None:
        """Remove the scope hooks (safe to call twice)."""
        for scope in getattr(self, "_scopes", []):
            scope.remove()
        entry = getattr(self, "_entry_points", None)
        if entry is not None:
            entry.remove()
        super().detach()

    def _kernel_handler(self, func: Any) -> Callable[..., Any] | None:
        """The handler of a known attention kernel (by op name or wrapped entry point), else None."""
        kernel = kernels.lookup(func)
        if kernel is None:
            return None
        handler = self._kernel_handlers.get(kernel.name)
        if handler is None:
            handler = self._make_handler(read_sdpa, kernel=kernel)
            self._kernel_handlers[kernel.name] = handler
        return handler

    def _make_handler(
        self, reader: Reader, eager: bool = False, kernel: kernels.Kernel | None = None
    ) -> Callable[..., Any]:
        def handler(
            path: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
        ) -> Any:
            skip = eager and path in self._inline and not attention_shaped(args, kwargs)
            if self.enabled and not skip and path not in self._off:
                self._reads[path] = self._reads.get(path, 0) + 1
                read = reader
                if eager and path in self._eager.sink_columns:
                    read = lambda a, kw: self._eager.read(path, a, kw)  # noqa: E731
                elif kernel is not None:
                    read = lambda a, kw: kernels.read_call(kernel, func, a, kw)  # noqa: E731
                try:
                    self._measure(path, read, func, args, kwargs)
                except ProbeError:
                    raise
                except Exception as exc:  # warn once for this module, stop watching it; strict raises
                    self._site_failed(path, exc)
            return func(*args, **kwargs)  # the original call, untouched

        return handler

    def _site_failed(self, path: str, exc: BaseException) -> None:
        module = self.modules[path]
        if self.ctx is not None and self.ctx.config.strict:
            raise ProbeError(f"stabkit probe 'attn' cannot read attention module {path!r}: {exc}") from exc
        if path not in self._off:
            self._off.add(path)
            hook_warning(
                f"stabkit: attention logits of {path!r} ({type(module).__name__}) are not measured: {exc}. "
                "Everything else is still monitored (MonitorConfig(strict=True) raises instead)",
                RuntimeWarning,
                stacklevel=4,
            )

    def _measure(
        self,
        path: str,
        reader: Reader,
        func: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """Statistics of one intercepted call (inside the attention module's forward, under no_grad)."""
        ctx = self.ctx
        assert ctx is not None
        cfg = ctx.config
        compiling = torch.compiler.is_compiling()
        if compiling:  # the round as a device tensor: no recompile per round
            sampling = Sampling(cfg.attn_sample_rows, cfg.attn_sample_queries, counter=ctx.phase.round)
        else:
            sampling = Sampling(
                cfg.attn_sample_rows, cfg.attn_sample_queries, ctx.step() // cfg.attention_every
            )
        module = self.modules[path]
        # no outer mode (e.g. a soft-capping one) sees the probe's own ops; no autocast to low precision
        with torch._C.DisableTorchFunction(), torch.no_grad(), no_autocast(args, kwargs):
            call = reader(args, kwargs)
            intervention_cap = positive_number(getattr(module, INTERVENTION_CAP_ATTR, None))
            # an eager softmax input is capped already (by the model, or by attn_softcap before the bias)
            seen_capped = (model_cap(module) or intervention_cap) if func in SOFTMAXES else None
            applied_cap = None if seen_capped else intervention_cap
            if isinstance(call, QKCall) and call.softcap is not None:
                applied_cap = call.softcap  # the kernel caps through its own argument
            if compiling:  # one opaque op (`stabkit.attention.measure.op`), one graph output
                self._measure_traced(call, sampling, path, applied_cap, seen_capped)
                return
            stats = measure(call, sampling, applied_cap, cfg.attn_chunk_bytes)
            # the summary's small ops run later, with every call's (`Recorder.defer`)
            self._kept.append((path, stats, seen_capped, applied_cap))
            ctx.recorder.defer(self._finish)

    @guarded
    def _finish(self) -> None:
        """Before the step's statistics are read (`Recorder.defer`): the summary of every call the
        probe measured since."""
        kept, self._kept = self._kept, []
        groups: dict[tuple[Any, ...], list[tuple[str, HeadStats]]] = {}
        for path, stats, seen_capped, applied_cap in kept:  # calls whose summaries have one layout
            key = (seen_capped, applied_cap, *_shape_of(stats))
            groups.setdefault(key, []).append((path, stats))
        with torch._C.DisableTorchFunction(), torch.no_grad():  # as in the handler: no mode sees them
            for (seen_capped, applied_cap, *_), calls in groups.items():
                self._record(calls, seen_capped, applied_cap)

    def _measure_traced(
        self,
        call: QKCall | LogitsCall,
        sampling: Sampling,
        path: str,
        applied_cap: float | None,
        seen_capped: float | None,
    ) -> None:
        """`_measure` while Dynamo traces (`stabkit.attention.measure.op`): a gated phase lets the op decide at run
        time; a call no op can take is traced as graph ops, so only into a sampled graph (a guard)."""
        ctx = self.ctx
        assert ctx is not None
        cfg, phase, every = ctx.config, ctx.phase, ctx.config.attention_every
        gated = phase.gated and opaque_ok(call)
        if phase.gated and not gated and not phase.on(every):
            return
        entries, vector = measured(
            call,
            sampling,
            applied_cap,
            seen_capped,
            cfg.attn_chunk_bytes,
            cfg.attn_per_head,
            phase.gate if gated else -1,
            every,
        )
        names = tuple(metric(ATTN, path, name) for name, _, _ in entries)
        combines = tuple(c for _, c, _ in entries)
        reductions = tuple(r for _, _, r in entries)
        ctx.recorder.add_packed(names, combines, reductions, vector, every=every if gated else None)

    def _record(
        self, calls: list[tuple[str, HeadStats]], seen_capped: float | None, applied_cap: float | None
    ) -> None:
        """Eager: the statistics of measured calls of one layout, as the compiled ops pack them
        (`stabkit.attention.measure.op`), summarised together: one vector per statistic, one value per call."""
        ctx = self.ctx
        assert ctx is not None
        per_head = ctx.config.attn_per_head
        capped = seen_capped is not None or applied_cap is not None
        stats = HeadStats.stacked([s for _, s in calls])  # (C, H) each
        entries = layout(stats.max_logit.shape[-1], stats.sink_sum is not None, capped, per_head)
        values = summary_values(stats, seen_capped, applied_cap, per_head)  # (C,) each
        rec = ctx.recorder
        for (name, combine, reduction), value in zip(entries, values, strict=True):
            names = tuple(metric(ATTN, path, name) for path, _ in calls)
            rec.add_vector(names, value, combine=combine, reduction=reduction)
        if self._split:
            local = stats.rows.shape[-1]
            heads = {p: h for p, _ in calls if (h := self._global_heads(p, local)) is not None}
            head_max = stats.max_logit if seen_capped is None else uncap(stats.max_logit, seen_capped)
            record_head_parts(rec, calls, heads, per_head, head_max)

    def _global_heads(self, path: str, local: int) -> tuple[int, int] | None:
        """(global query heads, this rank's first) of the module at `path` computing `local` heads."""
        if path not in self._heads:
            assert self.ctx is not None
            a = next((a for a in self.ctx.model_map.attentions if a.path == path), None)
            total = (a.n_heads if a is not None else None) or local
            offset = head_offset(self.ctx.model, a.q if a is not None else None, total, local)
            self._heads[path] = None if offset is None else (total, offset)
        return self._heads[path]

    def _on_exit(self, path: str, handled: int, output: Any) -> None:
        """After a scoped forward: a training-mode forward that made no call the probe can read means
        an attention implementation it does not understand (e.g. an unregistered custom kernel)."""
        self._eager.end(path)
        module = self.modules[path]
        if self._reads.pop(path, 0) == 0 and output is not None and module.training and self.enabled:
            self._site_failed(
                path,
                RuntimeError(
                    "its forward called neither F.scaled_dot_product_attention, a softmax over q·kᵀ, "
                    "F.multi_head_attention_forward nor a known attention kernel; register its kernel "
                    "with stabkit.register_kernel(...) to measure it"
                ),
            )


def _shape_of(stats: HeadStats) -> tuple[object, ...]:
    """What summarising a call with others depends on besides its caps: heads, first and sink sums,
    device (a model split across devices summarises each device's calls apart)."""
    first, sink = stats.first_sum is not None, stats.sink_sum is not None
    return stats.max_logit.shape[0], first, sink, stats.max_logit.device


def _mha_fast_path_possible(mha: nn.Module) -> bool:
    """True when nn.MultiheadAttention may take its fused inference path (eval, and no gradient
    needed); a function mode would divert it to the Python path, so the probe leaves it alone."""
    if mha.training:
        return False
    return not (torch.is_grad_enabled() and any(p.requires_grad for p in mha.parameters()))
