"""Turn one intercepted attention call into what the statistics read: q and k with a mask, or logits.

Runs inside the attention probe's handler (within the attention module's forward, sampled steps
only), before the original call proceeds unchanged. Nothing is computed here beyond the MHA
in-projection; the readers only bind arguments and bring masks to one 4-d convention
(``allowed``: bool, True = the query may see the key; ``bias``: additive term of the softmax input).

- ``F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)``:
  bool masks (True = may attend) or additive ones (entries <= finfo.min/2 or -inf count as masked);
- a softmax over the last dim (eager attention, e.g. Hugging Face ``attn_implementation="eager"``):
  its input *is* the logits plus the additive mask; entries <= finfo(dtype).min/2 count as masked;
- ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``): q and k from the in-projection
  weights and the call's (T, B, E) query/key, with MHA's mask semantics (bool True = may NOT
  attend; ``key_padding_mask``; ``is_causal`` as a hint that replaces ``attn_mask``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .call import LogitsCall, QKCall
from .math import SDPAArgs


def to4d(mask: torch.Tensor, score_dims: int) -> torch.Tensor:
    """A mask broadcastable to scores of `score_dims` (3: (B, L, S); 4: (B, H, L, S)) as a 4-d view."""
    if mask.dim() > score_dims:
        raise ValueError(
            f"attention mask of shape {tuple(mask.shape)} has more dims than the logits ({score_dims})"
        )
    mask = mask.reshape((1,) * (score_dims - mask.dim()) + tuple(mask.shape))
    return mask.unsqueeze(1) if score_dims == 3 else mask


def additive_allowed(mask: torch.Tensor) -> torch.Tensor:
    """bool allowed of an additive float mask: False at entries <= finfo.min/2 (and -inf)."""
    return ~(mask <= torch.finfo(mask.dtype).min / 2)


def _and(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a & b


def sdpa_call(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float | None
) -> QKCall:
    """The canonical call of SDPA-convention arguments: (B, H, L, E) / (B, Hkv, S, E) or 3-d (B, L, E)
    without heads; a bool mask (True = may attend) or an additive one (entries <= finfo.min/2 or -inf
    count as masked); causal top-left."""
    if q.dim() not in (3, 4) or k.dim() != q.dim():
        raise ValueError(
            f"scaled_dot_product_attention with query {tuple(q.shape)} and key {tuple(k.shape)}: "
            "the attention probe reads 3-d (B, L, E) or 4-d (B, H, L, E) inputs only"
        )
    dims = q.dim()
    if dims == 3:
        q, k = q.unsqueeze(1), k.unsqueeze(1)
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) are not a multiple of key heads ({k.shape[1]})")
    out = QKCall(q, k, scale, causal=bool(causal))
    if mask is not None:
        mask = to4d(mask, dims)
        if mask.dtype == torch.bool:
            out.allowed = mask
        else:
            out.allowed, out.bias = additive_allowed(mask), mask
    return out


def read_sdpa(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> QKCall:
    """Bind an ``F.scaled_dot_product_attention`` call (q, k as (B, H, L, E) / (B, Hkv, S, E), or 3-d)."""
    call = SDPAArgs.from_call(args, kwargs)
    return sdpa_call(call.query, call.key, call.attn_mask, bool(call.is_causal), call.scale)


def read_softmax(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> LogitsCall:
    """Bind an eager-attention softmax call: its (B, H, L, S) input over the last dim."""
    x = args[0] if args else kwargs["input"]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"softmax of {shape} inside an attention module; expected (B, H, L, S) float logits")
    if dim not in (-1, 3):
        raise ValueError(f"softmax over dim={dim!r} inside an attention module; expected the last (key) dim")
    return LogitsCall(x)


_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)


def read_mha(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> QKCall:
    """Bind an ``F.multi_head_attention_forward`` call and compute its q and k (float32, no grad)."""
    call = _MHA_SIGNATURE.bind(*args, **kwargs)
    call.apply_defaults()
    a = call.arguments
    for name in ("bias_k", "bias_v", "static_k", "static_v"):
        if a[name] is not None:
            raise ValueError(f"nn.MultiheadAttention with {name} is not supported by the attention probe")
    if a["add_zero_attn"]:
        raise ValueError(
            "nn.MultiheadAttention with add_zero_attn=True is not supported by the attention probe"
        )
    query, key = a["query"], a["key"]  # (L, B, E), (S, B, Ek); unbatched: (L, E), (S, Ek)
    kpm, attn_mask = a["key_padding_mask"], a["attn_mask"]
    if query.dim() == 2:
        query, key = query.unsqueeze(1), key.unsqueeze(1)
        kpm = kpm.unsqueeze(0) if kpm is not None else None
    n_q, bsz, embed = query.shape
    n_k = key.shape[0]
    heads = int(a["num_heads"])
    w, b = a["in_proj_weight"], a["in_proj_bias"]
    if a["use_separate_proj_weight"]:
        w_q, w_k = a["q_proj_weight"], a["k_proj_weight"]
    else:
        w_q, w_k = w[:embed], w[embed : 2 * embed]
    b_q, b_k = (None, None) if b is None else (b[:embed].float(), b[embed : 2 * embed].float())
    q = F.linear(query.float(), w_q.float(), b_q)  # (L, B, E)
    k = F.linear(key.float(), w_k.float(), b_k)  # (S, B, E)
    q = q.reshape(n_q, bsz, heads, -1).permute(1, 2, 0, 3)  # (B, H, L, hd)
    k = k.reshape(n_k, bsz, heads, -1).permute(1, 2, 0, 3)  # (B, H, S, hd)
    out = QKCall(q, k, None)
    if a["is_causal"] and kpm is None and not a["need_weights"]:
        out.causal = True  # MHA then runs SDPA with is_causal=True and ignores attn_mask
        attn_mask = None
    if attn_mask is not None:
        shape = (bsz, heads, n_q, n_k) if attn_mask.dim() == 3 else (1, 1, n_q, n_k)
        _add_mha_mask(out, attn_mask.reshape(shape))
    if kpm is not None:
        _add_mha_mask(out, kpm.reshape(bsz, 1, 1, n_k))
    return out


def _add_mha_mask(out: QKCall, mask: torch.Tensor) -> None:
    """Merge a 4-d MHA mask (bool True = may NOT attend, or additive float) into `out`."""
    if mask.dtype == torch.bool:
        out.allowed = _and(out.allowed, ~mask)
    else:
        out.allowed = _and(out.allowed, additive_allowed(mask))
        out.bias = mask if out.bias is None else out.bias + mask


Reader = Callable[[tuple[Any, ...], Mapping[str, Any]], "QKCall | LogitsCall"]
