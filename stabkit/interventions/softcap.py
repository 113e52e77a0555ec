"""Soft capping (Gemma 2): ``cap · tanh(x / cap)`` on attention logits and on the output logits.

``attn_softcap`` caps the scaled attention logits ``q kᵀ · scale`` before the mask and the softmax:

- SDPA attention (reference GPT, nanoGPT, HF ``attn_implementation="sdpa"``): calls to
  ``F.scaled_dot_product_attention`` made while the attention module runs are replaced by the math
  path of `stabkit.attention.math` with the cap (a scoped function mode, `stabkit.attention.scope`);
- eager attention (HF ``"eager"``, nanoGPT without flash): the q·kᵀ logits are capped before any
  additive bias, as on the SDPA path (`stabkit.interventions.softcap_eager`); masked entries (at or
  below ``finfo.min / 2``, or ``-inf``) are left as they are;
- a known kernel with a soft-cap argument (flash-attn ≥ 2.6 ``softcap``, FlexAttention ``score_mod``):
  through that argument, at the call autograd sees (flash-attn's Python entry points, whose autograd
  Function keeps the cap for its backward; a change its backward would not see is refused,
  `stabkit.interventions.kernel_change`); a kernel without one (xformers, Transformer Engine) is
  refused by name;
- ``nn.MultiheadAttention``: the decomposed forward of `stabkit.interventions.mha` calls SDPA visibly,
  which is then intercepted as above.

Each capped attention module carries ``_stabkit_attn_softcap = cap`` (read by the attention probe).
The scope is *outer* (pre-hook prepended), so an attention probe attached with ``outer=False`` sees
the raw call before the cap (on the eager path it sees the capped softmax input). `apply` checks one
forward that every capped module made a capped call (`stabkit.interventions.verify`); a module that
later runs without one is named in a warning (training goes on).

``logit_softcap`` caps the output head's output with a forward hook (prepended, so a z-loss hook on
the same head sees capped logits).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .. import metric_names as names
from ..attention import kernels
from ..attention.math import SDPAArgs
from ..attention.scope import SDPA, Handler, attach_scope
from ..plugins import INTERVENTIONS
from ..tables import bounds
from .base import Intervention
from .common import keep_hook, logits_map, model_map, set_attr, warn_internal_loss
from .handle import Handle, InterventionError
from .kernel_change import KernelChange
from .mha import SOFTCAP_ATTR, patch_mha
from .softcap_eager import EagerCap
from .verify import check_capped

if TYPE_CHECKING:
    from ..discovery.trace import Trace

ATTN = "attn_softcap"
LOGIT = "logit_softcap"
SDPA_IMPLS = ("sdpa", "hf:sdpa")
EAGER_IMPLS = ("eager", "hf:eager")


def _check_cap(name: str, cap: float) -> float:
    if not (isinstance(cap, float | int) and cap > 0 and cap != float("inf")):
        raise InterventionError(name, "", f"cap must be a positive finite number, got {cap!r}")
    return float(cap)


def _sdpa_handler(cap: float, handle: Handle) -> Handler:
    def handler(path: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        handle.count(path)
        return SDPAArgs.from_call(args, kwargs).run(softcap=cap)

    return handler


def _kernel_resolver(cap: float, change: KernelChange) -> Callable[[Any], Handler | None]:
    """Cap a known kernel's call through its own soft-cap argument (flash-attn's ``softcap`` at its
    entry points, FlexAttention's ``score_mod``), where its backward sees the cap (`KernelChange`)."""

    def resolve(func: Any) -> Handler | None:
        kernel = kernels.lookup(func)
        if kernel is None or kernel.cap is None:
            return None
        rewrite = kernel.cap

        def handler(path: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            return change.call(path, kernel, fn, args, kwargs, lambda arguments: rewrite(arguments, cap))

        return handler

    return resolve


def _warn_uncapped(handle: Handle) -> Callable[[str, int, Any], None]:
    """After a capped module's forward: warn once if it made no call that could be capped (the
    apply-time check makes this rare: the module's code changed since)."""
    said: set[str] = set()

    def on_exit(path: str, handled: int, output: Any) -> None:
        if output is not None and handled == 0 and path not in said:
            said.add(path)
            warnings.warn(
                f"stabkit: attn_softcap: {path!r} ran without a call stabkit could cap; its logits are not "
                "capped in this forward",
                RuntimeWarning,
                stacklevel=2,
            )

    return on_exit


def _route(a: Any, attn: nn.Module) -> str:
    """How an attention module is capped: 'mha', 'sdpa', 'eager' or 'kernel'; refusal otherwise."""
    if isinstance(attn, nn.MultiheadAttention):
        return "mha"
    if a.impl in SDPA_IMPLS:
        return "sdpa"
    if a.impl in EAGER_IMPLS:
        return "eager"
    if a.impl.startswith("kernel:"):
        kernel = kernels.KERNELS.get(a.impl.partition(":")[2])
        if kernel is None or kernel.cap is None:
            library = kernel.library if kernel is not None else a.impl
            raise InterventionError(
                ATTN,
                a.path,
                f"its attention runs in {library} ({a.impl.partition(':')[2]}), which has no soft-cap "
                "argument, and stabkit cannot cap logits inside a fused kernel (flash-attn >= 2.6 and "
                "FlexAttention can be capped)",
            )
        return "kernel"
    if a.impl.startswith("hf:"):
        raise InterventionError(
            ATTN,
            a.path,
            f"Hugging Face attention implementation {a.impl[3:]!r} runs a kernel stabkit cannot cap here "
            "(flex_attention is compiled by transformers); load the model with attn_implementation='sdpa' "
            "or 'eager', or cap with the kernel itself",
        )
    raise InterventionError(
        ATTN,
        a.path,
        f"attention implementation {a.impl!r} cannot be intercepted; supported: SDPA, eager softmax "
        "attention, nn.MultiheadAttention, flash-attn and FlexAttention (pass example= to trace a forward)",
    )


def apply_attn_softcap(model: nn.Module, cap: float = 50.0, model_map_override: Any = None) -> Handle:
    """Cap every attention module's logits at ``cap`` (see the module docstring). Runs at each forward."""
    from ..discovery.families import STABKIT_GPT, declared_family

    cap = _check_cap(ATTN, cap)
    mmap = model_map(model, ATTN, model_map_override)
    handle = Handle(model, [ATTN])
    routes: dict[str, list[str]] = {"sdpa": [], "eager": [], "kernel": []}
    try:
        for a in {a.path: a for a in mmap.attentions}.values():
            attn = model.get_submodule(a.path)
            own = getattr(attn, "softcap", None) if declared_family(attn) == STABKIT_GPT else None
            hf_cap = getattr(getattr(attn, "config", None), "attn_logit_softcapping", None)
            if getattr(attn, SOFTCAP_ATTR, None) is not None or own is not None or hf_cap is not None:
                raise InterventionError(ATTN, a.path, "its attention logits are soft-capped already")
            route = _route(a, attn)
            if route == "mha":
                patch_mha(handle, model, a.path, ATTN)
                route = "sdpa"
            routes[route].append(a.path)
            set_attr(handle, attn, SOFTCAP_ATTR, cap)
        on_exit = _warn_uncapped(handle)
        if routes["sdpa"] or routes["kernel"]:
            paths = routes["sdpa"] + routes["kernel"]
            change = KernelChange(ATTN, handle)
            scope = attach_scope(
                model,
                paths,
                {SDPA: _sdpa_handler(cap, handle)},
                outer=True,
                on_exit=on_exit,
                resolve=_kernel_resolver(cap, change),
                on_enter=change.enter,
            )
            keep_hook(handle, scope)
            keep_hook(handle, kernels.install((model,)))
        if routes["eager"]:
            eager = EagerCap(cap, handle)

            def end(path: str, handled: int, output: Any) -> None:
                eager.end(path)
                on_exit(path, handle.counts.get(path, 0), output)

            scope = attach_scope(
                model, routes["eager"], eager.functions(), outer=True, on_exit=end, resolve=eager.resolve
            )
            keep_hook(handle, scope)
        handle.capped_paths = [p for paths in routes.values() for p in paths]  # type: ignore[attr-defined]
    except BaseException:
        handle.remove()
        raise
    return handle


def apply_logit_softcap(model: nn.Module, cap: float = 30.0, model_map_override: Any = None) -> Handle:
    """Cap the final logits at ``cap`` with a forward hook where they are made. Runs at each forward."""
    cap = _check_cap(LOGIT, cap)
    cfg = getattr(model, "config", None)
    if getattr(cfg, "logit_softcap", None) or getattr(cfg, "final_logit_softcapping", None):
        raise InterventionError(LOGIT, type(model).__name__, "the model soft-caps its output logits already")
    where = logits_map(model, LOGIT, model_map_override)
    module = model.get_submodule(where.path)
    handle = Handle(model, [LOGIT])
    said: set[int] = set()

    def hook(mod: nn.Module, args: Any, out: Any) -> Any:
        logits = where.take(out)
        if not isinstance(logits, torch.Tensor):
            return None
        warn_internal_loss(LOGIT, where.path, out, said)
        return where.replace(out, cap * torch.tanh(logits / cap))

    keep_hook(handle, module.register_forward_hook(hook, prepend=True))
    return handle


def _cap_at_switch(default: float, seen: list[float], margin: float) -> dict[str, Any]:
    """A mid-run cap: `margin` × the largest finite logged value, or `default` if larger."""
    top = max((v for v in seen if math.isfinite(v)), default=0.0)
    return {"cap": max(default, margin * top)}


@dataclass(frozen=True)
class AttnSoftcapOptions:
    """The options of ``attn_softcap``."""

    cap: float = field(default=50.0, metadata=bounds(lo=0.0, lo_open=True))
    """Attention logits become cap·tanh(logits/cap) (Gemma 2: 50)."""


@INTERVENTIONS.register
class AttnSoftcapIntervention(Intervention):
    """``attn_softcap`` (attention: after qk_norm). At a mid-run switch the cap starts at the rescue's
    margin × the newest logged max attention logit, or the default if larger, where
    ``c·tanh(x/c)`` is within ≈ 8 % of x at the max and much closer below it."""

    name = ATTN
    order = 40
    description = "cap·tanh(logits/cap) on attention logits before the softmax (Gemma 2)"
    options_class = AttnSoftcapOptions
    midrun = True
    midrun_preference = 20

    def apply(self, model: nn.Module, model_map: Any, options: AttnSoftcapOptions) -> Handle:
        return apply_attn_softcap(model, options.cap, model_map)

    def verify(self, trace: Trace, model: nn.Module, handle: Handle) -> None:
        check_capped(ATTN, handle)

    def midrun_options(self, metrics: Mapping[str, float], margin: float) -> dict[str, Any]:
        seen = [v for k, v in metrics.items() if names.is_stat(k, names.ATTN, "max_logit")]
        return _cap_at_switch(AttnSoftcapOptions().cap, seen, margin)


@dataclass(frozen=True)
class LogitSoftcapOptions:
    """The options of ``logit_softcap``."""

    cap: float = field(default=30.0, metadata=bounds(lo=0.0, lo_open=True))
    """Output logits become cap·tanh(logits/cap) (Gemma 2: 30)."""


@INTERVENTIONS.register
class LogitSoftcapIntervention(Intervention):
    """``logit_softcap`` (output logits: after attention). At a mid-run switch the cap starts at the
    rescue's margin × the newest logged max |logit| (``logits/max_abs``), or the default if larger."""

    name = LOGIT
    order = 50
    description = "cap·tanh(logits/cap) on the output logits (Gemma 2)"
    options_class = LogitSoftcapOptions
    midrun = True
    midrun_preference = 40

    def apply(self, model: nn.Module, model_map: Any, options: LogitSoftcapOptions) -> Handle:
        return apply_logit_softcap(model, options.cap, model_map)

    def midrun_options(self, metrics: Mapping[str, float], margin: float) -> dict[str, Any]:
        seen = [v for k, v in metrics.items() if k == "logits/max_abs"]
        return _cap_at_switch(LogitSoftcapOptions().cap, seen, margin)
