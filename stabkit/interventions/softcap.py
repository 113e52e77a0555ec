"""Soft capping (Gemma 2): ``cap · tanh(x / cap)`` on attention logits and on the output logits.

``attn_softcap`` caps the scaled attention logits ``q kᵀ · scale`` before the mask and the softmax:

- SDPA attention (reference GPT, nanoGPT, HF ``attn_implementation="sdpa"``): calls to
  ``F.scaled_dot_product_attention`` made while the attention module runs are replaced by the math
  path of `stabkit.attention.math` with the cap (a scoped function mode, `stabkit.attention.scope`);
- eager attention (HF ``"eager"``, nanoGPT without flash): the softmax input inside the attention
  module is capped. The mask has already been added there, so only unmasked entries are capped:
  entries at or below ``finfo.min / 2`` (masked with ``finfo.min``) or ``-inf`` are left as they are;
- ``nn.MultiheadAttention``: the decomposed forward of `stabkit.interventions.mha` calls SDPA visibly,
  which is then intercepted as above.

Each capped attention module carries ``_stabkit_attn_softcap = cap`` (read by the attention probe).
The scope is *outer* (pre-hook prepended), so an attention probe attached with ``outer=False`` sees
the raw call before the cap. If a capped module ever runs without making an intercepted call, the
forward raises InterventionError (never a silent no-op).

``logit_softcap`` caps the output head's output with a forward hook (prepended, so a z-loss hook on
the same head sees capped logits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..attention.math import SDPAArgs
from ..attention.scope import SDPA, SOFTMAXES, Handler, attach_scope
from .common import keep_hook, logits_map, model_map, set_attr, warn_internal_loss
from .handle import Handle, InterventionError
from .mha import SOFTCAP_ATTR, patch_mha

ATTN = "attn_softcap"
LOGIT = "logit_softcap"
SDPA_IMPLS = ("sdpa", "hf:sdpa")
EAGER_IMPLS = ("eager", "hf:eager")


def _check_cap(name: str, cap: float) -> float:
    if not (isinstance(cap, float | int) and cap > 0 and cap != float("inf")):
        raise InterventionError(name, "", f"cap must be a positive finite number, got {cap!r}")
    return float(cap)


def capped_scores(x: torch.Tensor, cap: float) -> torch.Tensor:
    """Cap the unmasked entries of masked attention logits; masked ones (<= finfo.min/2, -inf) stay."""
    threshold = torch.finfo(x.dtype).min / 2
    return torch.where(x > threshold, cap * torch.tanh(x / cap), x)


def _sdpa_handler(cap: float) -> Handler:
    def handler(path: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return SDPAArgs.from_call(args, kwargs).run(softcap=cap)

    return handler


def _softmax_handler(cap: float) -> Handler:
    def handler(path: str, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        x = args[0] if args else kwargs.get("input")
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 4 or dim not in (-1, 3):
            return func(*args, **kwargs)  # not attention weights (e.g. an MoE router inside the scope)
        return func(capped_scores(x, cap), *args[1:], **kwargs)

    return handler


def _check_called(path: str, handled: int, output: Any) -> None:
    if output is not None and handled == 0:
        raise InterventionError(
            ATTN,
            path,
            "the module ran without calling scaled_dot_product_attention or softmax, so the cap was not "
            "applied; its attention implementation is not supported (use SDPA or eager attention)",
        )


def apply_attn_softcap(model: nn.Module, cap: float = 50.0, model_map_override: Any = None) -> Handle:
    """Cap every attention module's logits at ``cap`` (see the module docstring). Runs at each forward."""
    from ..harness.models.layers import Attention as StabkitAttention

    cap = _check_cap(ATTN, cap)
    mmap = model_map(model, ATTN, model_map_override)
    handle = Handle(model, [ATTN])
    sdpa_paths: list[str] = []
    eager_paths: list[str] = []
    try:
        for a in {a.path: a for a in mmap.attentions}.values():
            attn = model.get_submodule(a.path)
            own = getattr(attn, "softcap", None) if isinstance(attn, StabkitAttention) else None
            hf_cap = getattr(getattr(attn, "config", None), "attn_logit_softcapping", None)
            if getattr(attn, SOFTCAP_ATTR, None) is not None or own is not None or hf_cap is not None:
                raise InterventionError(ATTN, a.path, "its attention logits are soft-capped already")
            if isinstance(attn, nn.MultiheadAttention):
                patch_mha(handle, model, a.path, ATTN)
                sdpa_paths.append(a.path)
            elif a.impl in SDPA_IMPLS:
                sdpa_paths.append(a.path)
            elif a.impl in EAGER_IMPLS:
                eager_paths.append(a.path)
            else:
                raise InterventionError(
                    ATTN,
                    a.path,
                    f"attention implementation {a.impl!r} cannot be intercepted; supported: SDPA, eager "
                    "softmax attention and nn.MultiheadAttention (pass example= to trace a forward)",
                )
            set_attr(handle, attn, SOFTCAP_ATTR, cap)
        if sdpa_paths:
            scope = attach_scope(
                model, sdpa_paths, {SDPA: _sdpa_handler(cap)}, outer=True, on_exit=_check_called
            )
            keep_hook(handle, scope)
        if eager_paths:
            handler = _softmax_handler(cap)
            functions = dict.fromkeys(SOFTMAXES, handler)
            keep_hook(handle, attach_scope(model, eager_paths, functions, outer=True, on_exit=_check_called))
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

    def hook(mod: nn.Module, args: Any, out: Any) -> Any:
        logits = where.take(out)
        if not isinstance(logits, torch.Tensor):
            return None
        warn_internal_loss(LOGIT, where.path, out)
        return where.replace(out, cap * torch.tanh(logits / cap))

    keep_hook(handle, module.register_forward_hook(hook, prepend=True))
    return handle
