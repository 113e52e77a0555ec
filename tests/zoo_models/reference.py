"""Independent reference for attention logit maxima: what every attention call of one forward saw.

`attention_logit_maxima` runs the forward under a `TorchFunctionMode` and, for each attention call,
records the maximum attention logit over the entries the call lets a query see, in call order:

- ``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)``:
  ``q @ kᵀ · scale`` in float64 (scale defaults to 1/sqrt(head_dim); ``enable_gqa`` repeats each key
  head). Allowed entries: bool ``attn_mask`` True; additive float ``attn_mask`` > finfo.min/2 (the
  additive term itself is not added); ``is_causal``: key j <= query i (top-left aligned).
- a softmax over the last dim of a 4-d float tensor (eager attention: ``F.softmax``, ``torch.softmax``,
  ``Tensor.softmax``, ``nn.Softmax``): the max of its input (logits plus any additive mask or bias)
  over entries > finfo(dtype).min/2.
- attention sinks (GPT-OSS eager attention): ``torch.cat([logits, sink], dim=-1)`` of a 4-d float
  ``logits`` (B, H, L, S) — q·kᵀ·scale plus the additive mask — and a (B, H, L, 1) sink column, whose
  result, shifted by its row max, is the softmax input. The softmax input is no reading of the logits
  here: each row is shifted so that its max is 0 (its max |x| is the row's range, sink included), and
  the sink is a learned per-head logit no query·key product makes. So the reference takes the cat's
  first operand (the max over its entries > finfo.min/2, as for a softmax input) and records it when a
  tensor computed from the cat's result by same-shape operations (the shift) reaches a 4-d softmax — one
  record per attention call, at the softmax, in call order. A cat whose result never reaches a softmax
  records nothing.
- ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``): q and k from the in-projection
  weights, ``q @ kᵀ / sqrt(head_dim)`` in float64. Allowed entries: bool masks False (MHA's convention:
  True = may NOT attend), float masks > finfo.min/2, for both ``attn_mask`` and ``key_padding_mask``;
  ``is_causal`` without a mask: key j <= query i.

Calls made *inside* an intercepted call (e.g. the SDPA inside ``multi_head_attention_forward``) are not
seen: a mode is switched off while its handler runs. The mode only reads: every call proceeds with its
own arguments, so the forward's results do not change.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

_SOFTMAXES = {F.softmax, torch.softmax, torch.Tensor.softmax, torch._C._VariableFunctions.softmax}
_CATS = {torch.cat, torch.concat, torch.concatenate, torch._C._VariableFunctions.cat}
_SDPA_SIG = inspect.signature(
    lambda query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False: (
        None
    )
)
_MHA_SIG = inspect.signature(F.multi_head_attention_forward)


def _masked_max(logits: torch.Tensor, allowed: torch.Tensor | None, absolute: bool) -> float:
    values = logits.abs() if absolute else logits
    if allowed is not None:
        values = values.masked_fill(~allowed.expand_as(values), -math.inf)
    return float(values.max())


def _causal(n_q: int, n_k: int, device: torch.device) -> torch.Tensor:
    return torch.ones(n_q, n_k, dtype=torch.bool, device=device).tril()


def _float_allowed(mask: torch.Tensor) -> torch.Tensor:
    return mask > torch.finfo(mask.dtype).min / 2


def sdpa_max(args: tuple, kwargs: Mapping[str, Any], absolute: bool = False) -> float:
    """Max logit of one ``F.scaled_dot_product_attention`` call."""
    a = _SDPA_SIG.bind(*args, **kwargs).arguments
    q, k = a["query"].double(), a["key"].double()
    if a.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scale = a.get("scale")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    logits = q @ k.transpose(-2, -1) * scale  # (..., L, S)
    allowed = None
    mask = a.get("attn_mask")
    if mask is not None:
        allowed = mask if mask.dtype == torch.bool else _float_allowed(mask)
    if a.get("is_causal"):
        causal = _causal(q.shape[-2], k.shape[-2], q.device)
        allowed = causal if allowed is None else allowed & causal
    return _masked_max(logits, allowed, absolute)


def softmax_max(x: torch.Tensor, absolute: bool = False) -> float:
    """Max of an eager-attention softmax input over its unmasked entries."""
    return _masked_max(x.double(), _float_allowed(x), absolute)


def mha_max(args: tuple, kwargs: Mapping[str, Any], absolute: bool = False) -> float:
    """Max logit of one ``F.multi_head_attention_forward`` call (q, k recomputed from its weights)."""
    bound = _MHA_SIG.bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    for name in ("bias_k", "bias_v", "static_k", "static_v"):
        if a[name] is not None:
            raise NotImplementedError(f"reference: multi_head_attention_forward with {name}")
    if a["add_zero_attn"]:
        raise NotImplementedError("reference: multi_head_attention_forward with add_zero_attn")
    query, key = a["query"].double(), a["key"].double()  # (L, B, E), (S, B, E); unbatched (L, E)
    key_padding_mask = a["key_padding_mask"]
    if query.dim() == 2:
        query, key = query.unsqueeze(1), key.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    n_q, batch, embed = query.shape
    n_k, heads = key.shape[0], a["num_heads"]
    if a["use_separate_proj_weight"]:
        w_q, w_k = a["q_proj_weight"], a["k_proj_weight"]
    else:
        w_q, w_k = a["in_proj_weight"][:embed], a["in_proj_weight"][embed : 2 * embed]
    bias = a["in_proj_bias"]
    b_q = None if bias is None else bias[:embed].double()
    b_k = None if bias is None else bias[embed : 2 * embed].double()
    q = F.linear(query, w_q.double(), b_q).reshape(n_q, batch, heads, -1).permute(1, 2, 0, 3)
    k = F.linear(key, w_k.double(), b_k).reshape(n_k, batch, heads, -1).permute(1, 2, 0, 3)
    logits = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, L, S)
    allowed = torch.ones(batch, heads, n_q, n_k, dtype=torch.bool, device=q.device)
    attn_mask = a["attn_mask"]
    if attn_mask is not None:
        shape = (batch, heads, n_q, n_k) if attn_mask.dim() == 3 else (1, 1, n_q, n_k)
        attn_mask = attn_mask.reshape(shape)
        allowed = allowed & (~attn_mask if attn_mask.dtype == torch.bool else _float_allowed(attn_mask))
    elif a["is_causal"]:
        allowed = allowed & _causal(n_q, n_k, q.device)
    if key_padding_mask is not None:
        kpm = key_padding_mask.reshape(batch, 1, 1, n_k)
        allowed = allowed & (~kpm if kpm.dtype == torch.bool else _float_allowed(kpm))
    return _masked_max(logits, allowed, absolute)


class AttentionLogitRecorder(TorchFunctionMode):
    """Records the max attention logit of every attention call made while the mode is active."""

    def __init__(self, absolute: bool = False) -> None:
        super().__init__()
        self.absolute = absolute
        self.maxima: list[float] = []
        self.kinds: list[str] = []
        # id of a tensor computed from a sink cat -> (that tensor, kept alive so its id stays unique; the max
        # logit of the cat's first operand)
        self._sinked: dict[int, tuple[torch.Tensor, float]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch.no_grad():
            if func is F.scaled_dot_product_attention:
                self._record("sdpa", sdpa_max(args, kwargs, self.absolute))
            elif func is F.multi_head_attention_forward:
                self._record("mha", mha_max(args, kwargs, self.absolute))
            elif func in _SOFTMAXES:
                x = args[0] if args else kwargs.get("input", kwargs.get("self"))
                dim = args[1] if len(args) > 1 else kwargs.get("dim")
                if isinstance(x, torch.Tensor) and x.dim() == 4 and x.is_floating_point() and dim in (-1, 3):
                    if id(x) in self._sinked:
                        self._record("sink-softmax", self._sinked.pop(id(x))[1])
                    else:
                        self._record("softmax", softmax_max(x, self.absolute))
        out = func(*args, **kwargs)
        if func not in _SOFTMAXES and isinstance(out, torch.Tensor):
            with torch.no_grad():
                self._track_sinks(func, args, kwargs, out)
        return out

    def _track_sinks(self, func, args: tuple, kwargs: Mapping[str, Any], out: torch.Tensor) -> None:
        """Remember a sink cat's result, and each same-shape tensor computed from a remembered one."""
        if func in _CATS:
            parts = args[0] if args else kwargs.get("tensors", kwargs.get("input"))
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            if (
                isinstance(parts, (list, tuple))
                and len(parts) == 2
                and all(isinstance(p, torch.Tensor) and p.dim() == 4 and p.is_floating_point() for p in parts)
                and dim in (-1, 3)
                and parts[1].shape[-1] == 1
                and parts[0].shape[:-1] == parts[1].shape[:-1]
            ):
                self._sinked[id(out)] = (out, softmax_max(parts[0], self.absolute))
            return
        if not self._sinked:
            return
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor) and id(a) in self._sinked and a.shape == out.shape:
                self._sinked[id(out)] = (out, self._sinked[id(a)][1])
                return

    def _record(self, kind: str, value: float) -> None:
        self.kinds.append(kind)
        self.maxima.append(value)


def attention_logit_maxima(
    model: nn.Module, args: tuple = (), kwargs: Mapping[str, Any] | None = None, *, absolute: bool = False
) -> list[float]:
    """Per-call max attention logit (max |logit| with `absolute`) of one ``model(*args, **kwargs)``."""
    recorder = AttentionLogitRecorder(absolute)
    with recorder:
        model(*args, **(kwargs or {}))
    return recorder.maxima
