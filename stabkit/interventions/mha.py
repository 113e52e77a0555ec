"""A decomposed ``nn.MultiheadAttention.forward`` that interventions can reach into.

``nn.MultiheadAttention`` computes q, k and v inside ``F.multi_head_attention_forward`` (or a fused
C++ kernel), out of reach of module hooks. `patch_mha` replaces the instance's ``forward`` by
`decomposed_forward`, which computes the projections itself, applies the QK-norm gains attached by
``qk_norm`` (``stabkit_qk_norm``), and calls ``F.scaled_dot_product_attention`` visibly, so the
scoped function modes of ``attn_softcap`` and of the attention probe see it like on any SDPA model.
Several interventions share one patch (reference counted); the original ``forward`` comes back when
the last one is removed. Runs at every forward of the patched module.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.math import math_attention
from .common import QK_NORM_ATTR, keep_slow_path, no_op_pre_hook
from .handle import Handle, InterventionError

SOFTCAP_ATTR = "_stabkit_attn_softcap"
_PATCH_ATTR = "_stabkit_mha_users"
_MISSING = object()


def _as_additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MHA masks: bool True = may NOT attend (opposite of SDPA) -> additive float; float masks as they are."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(dtype)


def decomposed_forward(
    mha: nn.MultiheadAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as ``nn.MultiheadAttention.forward`` (no bias_k/bias_v, no add_zero_attn).

    Returned weights (``need_weights``) are computed by the math path, before dropout.
    """
    batched = query.dim() == 3
    if not batched:  # (L, E) -> (1, L, E)
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif not mha.batch_first:  # (L, N, E) -> (N, L, E)
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    n, q_len, _ = query.shape
    s_len = key.shape[1]
    heads, hd = mha.num_heads, mha.head_dim
    if mha._qkv_same_embed_dim:
        w_q, w_k, w_v = mha.in_proj_weight.chunk(3)
    else:
        w_q, w_k, w_v = mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight
    b_q, b_k, b_v = mha.in_proj_bias.chunk(3) if mha.in_proj_bias is not None else (None, None, None)
    q = F.linear(query, w_q, b_q)  # (N, L, E)
    k = F.linear(key, w_k, b_k)  # (N, S, E)
    v = F.linear(value, w_v, b_v)
    norms = mha._modules.get(QK_NORM_ATTR)
    if norms is not None:
        q, k = norms.get_submodule("q")(q), norms.get_submodule("k")(k)
    q = q.unflatten(-1, (heads, hd)).transpose(1, 2)  # (N, H, L, hd)
    k = k.unflatten(-1, (heads, hd)).transpose(1, 2)  # (N, H, S, hd)
    v = v.unflatten(-1, (heads, hd)).transpose(1, 2)
    mask: torch.Tensor | None = None
    if attn_mask is not None:
        mask = _as_additive(attn_mask, q.dtype)
        if mask.dim() == 3:  # (N*H, L, S)
            mask = mask.view(n, heads, q_len, s_len)
    if key_padding_mask is not None:
        pad = _as_additive(key_padding_mask, q.dtype).view(n, 1, 1, s_len)
        mask = pad if mask is None else mask + pad
    causal = is_causal and mask is None
    drop = mha.dropout if mha.training else 0.0
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=drop, is_causal=causal
    )  # (N, H, L, hd)
    weights = None
    if need_weights:
        cap = getattr(mha, SOFTCAP_ATTR, None)
        _, weights = math_attention(
            q, k, v, attn_mask=mask, is_causal=causal, softcap=cap, return_weights=True
        )
        if average_attn_weights:
            weights = weights.mean(dim=1)  # (N, L, S)
        if not batched:
            weights = weights.squeeze(0)
    out = out.transpose(1, 2).reshape(n, q_len, heads * hd)  # (N, L, E)
    out = F.linear(out, mha.out_proj.weight, mha.out_proj.bias)
    if not batched:
        out = out.squeeze(0)
    elif not mha.batch_first:
        out = out.transpose(0, 1)
    return out, weights


def patch_mha(handle: Handle, model: nn.Module, path: str, user: str) -> nn.MultiheadAttention:
    """Install `decomposed_forward` on the ``nn.MultiheadAttention`` at `path` for intervention `user`."""
    mha = model.get_submodule(path)
    if not isinstance(mha, nn.MultiheadAttention):
        raise InterventionError(user, path, f"expected nn.MultiheadAttention, found {type(mha).__name__}")
    if mha.bias_k is not None or mha.bias_v is not None or mha.add_zero_attn:
        raise InterventionError(
            user, path, "bias_k/bias_v/add_zero_attn are not supported by the decomposed forward"
        )
    users: set[str] | None = mha.__dict__.get(_PATCH_ATTR)
    if users is None:
        users = set()
        old_forward = mha.__dict__.get("forward", _MISSING)
        mha.__dict__[_PATCH_ATTR] = users
        mha.forward = partial(decomposed_forward, mha)  # type: ignore[method-assign]
        hook = mha.register_forward_pre_hook(
            no_op_pre_hook
        )  # any hook in the layer turns off the fused fast path

        def unpatch() -> None:
            hook.remove()
            if old_forward is _MISSING:
                mha.__dict__.pop("forward", None)
            else:
                mha.__dict__["forward"] = old_forward
            mha.__dict__.pop(_PATCH_ATTR, None)

        mha.__dict__["_stabkit_mha_unpatch"] = unpatch
    users.add(user)
    keep_slow_path(handle, model, path)

    def release() -> None:
        users.discard(user)
        if not users:
            mha.__dict__.pop("_stabkit_mha_unpatch")()

    handle.on_remove(release)
    return mha
