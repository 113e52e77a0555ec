"""Reference ("math") attention: every step of softmax attention materialised, with hooks for score changes.

Runs inside the forward pass whenever stabkit replaces a fused attention call (an intercepted
``F.scaled_dot_product_attention``, see `stabkit.attention.scope`) — soft capping needs the logits,
which fused kernels never materialise — and whenever a probe wants the logits themselves.

Semantics follow ``torch.nn.functional.scaled_dot_product_attention``:

- ``scale`` defaults to 1/sqrt(head_dim);
- ``attn_mask`` is either boolean (True = may attend) or additive (added to the logits);
- ``is_causal`` uses the top-left aligned lower-triangular mask (query i sees keys j <= i) and
  cannot be combined with ``attn_mask``;
- ``enable_gqa`` repeats each key/value head ``Hq / Hkv`` times (grouped-query attention);
- rows whose keys are all masked give zero weights (SDPA's math backend does the same);
- dropout is applied to the weights whenever ``dropout_p > 0`` (SDPA does not look at ``training``).

Order inside the logits: ``q kᵀ · scale`` → ``score_mod`` → soft cap → mask → softmax → dropout → ``@ v``.
``score_mod`` has FlexAttention's signature ``(score, b, h, q_idx, kv_idx) -> score``, called once on
the whole (B, H, L, S) tensor with broadcastable index tensors, so one function serves both paths.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""FlexAttention-style score modifier: (score, b, h, q_idx, kv_idx) -> new score."""

_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS: dict[str, Any] = {
    "attn_mask": None,
    "dropout_p": 0.0,
    "is_causal": False,
    "scale": None,
    "enable_gqa": False,
}


@dataclass
class SDPAArgs:
    """The arguments of one ``F.scaled_dot_product_attention`` call, by name."""

    query: torch.Tensor
    """(..., Hq, L, E)"""
    key: torch.Tensor
    """(..., Hkv, S, E)"""
    value: torch.Tensor
    """(..., Hkv, S, Ev)"""
    attn_mask: torch.Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False

    @classmethod
    def from_call(cls, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> SDPAArgs:
        """Bind the positional and keyword arguments of an intercepted SDPA call."""
        kwargs = dict(kwargs or {})
        if len(args) > len(_SDPA_PARAMS):
            raise TypeError(f"scaled_dot_product_attention takes at most {len(_SDPA_PARAMS)} arguments")
        named = dict(zip(_SDPA_PARAMS, args, strict=False))
        unknown = sorted(set(kwargs) - set(_SDPA_PARAMS))
        if unknown:
            raise TypeError(f"scaled_dot_product_attention got unexpected argument(s) {unknown}")
        named.update(kwargs)
        for name, default in _SDPA_DEFAULTS.items():
            named.setdefault(name, default)
        return cls(**named)

    def run(self, **changes: Any) -> torch.Tensor:
        """`math_attention` on these arguments (``changes`` adds e.g. ``softcap=`` or ``score_mod=``)."""
        return math_attention(
            self.query,
            self.key,
            self.value,
            attn_mask=self.attn_mask,
            dropout_p=self.dropout_p,
            is_causal=self.is_causal,
            scale=self.scale,
            enable_gqa=self.enable_gqa,
            **changes,
        )


def causal_mask(q_len: int, kv_len: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean (L, S) mask, True where query i may attend key j (j <= i, top-left aligned like SDPA)."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril()


def expand_kv(query: torch.Tensor, kv: torch.Tensor, enable_gqa: bool) -> torch.Tensor:
    """Repeat the key/value heads (dim -3) to the number of query heads when ``enable_gqa``."""
    if not enable_gqa or query.dim() < 3 or kv.shape[-3] == query.shape[-3]:
        return kv
    hq, hkv = query.shape[-3], kv.shape[-3]
    if hq % hkv:
        raise ValueError(f"enable_gqa needs query heads ({hq}) to be a multiple of key/value heads ({hkv})")
    return kv.repeat_interleave(hq // hkv, dim=-3)


def attention_logits(
    query: torch.Tensor,
    key: torch.Tensor,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Scaled logits ``q kᵀ · scale`` of shape (..., Hq, L, S), before any cap or mask."""
    if scale is None:
        scale = query.shape[-1] ** -0.5
    key = expand_kv(query, key, enable_gqa)
    return (query @ key.transpose(-2, -1)) * scale  # (..., H, L, S)


def softcap_score_mod(cap: float) -> ScoreMod:
    """A score_mod computing ``cap · tanh(score / cap)`` (Gemma 2's attention soft cap)."""

    def score_mod(score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> torch.Tensor:
        return cap * torch.tanh(score / cap)

    return score_mod


def _index_tensors(scores: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Broadcastable (b, h, q_idx, kv_idx) index tensors, each 4-d, for a score_mod on (..., H, L, S) scores."""
    shape4 = ((1,) * 4 + tuple(scores.shape))[-4:]  # (B, H, L, S), missing leading dims as 1
    out = []
    for axis, size in enumerate(shape4):
        view = [1, 1, 1, 1]
        view[axis] = size
        out.append(torch.arange(size, device=scores.device).view(view))
    return tuple(out)


def math_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    softcap: float | None = None,
    score_mod: ScoreMod | None = None,
    return_weights: bool = False,
) -> Any:
    """Attention with materialised logits; same arguments and result as SDPA (see the module docstring).

    Returns the output (..., Hq, L, Ev), or ``(output, weights)`` with the (..., Hq, L, S) attention
    weights (before dropout) when ``return_weights``.
    """
    if is_causal and attn_mask is not None:
        raise ValueError("math_attention: pass either attn_mask or is_causal=True, not both (as SDPA)")
    scores = attention_logits(query, key, scale, enable_gqa)  # (..., H, L, S)
    low_precision = scores.dtype in (torch.float16, torch.bfloat16)
    if low_precision:
        scores = scores.float()
    if score_mod is not None:
        scores = score_mod(scores, *_index_tensors(scores)).reshape(scores.shape)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    fully_masked: torch.Tensor | None = None
    if is_causal:
        allowed = causal_mask(scores.shape[-2], scores.shape[-1], scores.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
    elif attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.to(scores.dtype)
        fully_masked = torch.isneginf(scores).all(dim=-1, keepdim=True)  # (..., H, L, 1)
    weights = torch.softmax(scores, dim=-1)
    if fully_masked is not None:
        weights = weights.masked_fill(fully_masked, 0.0)
    weights = weights.to(value.dtype)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    out = dropped @ expand_kv(query, value, enable_gqa)  # (..., H, L, Ev)
    return (out, weights) if return_weights else out
