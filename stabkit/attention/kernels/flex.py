"""FlexAttention: read at its higher-order op ``higher_order::flex_attention``, which
``torch.nn.attention.flex_attention.flex_attention`` calls in eager mode (the op is what a function
mode sees; the Python function itself is not).

The op gets (query (B, H, L, E), key (B, Hkv, S, E), value, score_mod, block_mask as a tuple, scale,
kernel_options, score_mod buffers, mask_mod buffers). The block-mask tuple is
``BlockMask.as_tuple()``: (L, S, kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices, …,
Q_BLOCK_SIZE, KV_BLOCK_SIZE, mask_mod). An entry is allowed when its (query block, key block) pair is
a *full* block, or a *partial* block whose ``mask_mod(b, h, q_idx, kv_idx)`` is True — what the
compiled kernel computes on a GPU (eager FlexAttention on a CPU evaluates mask_mod everywhere; the
two agree for block masks made by ``create_block_mask``). ``score_mod`` changes the scores the softmax
sees (soft caps, ALiBi, relative biases): it enters the entropy, while the max logit stays the raw
``q·k·scale``, as an additive mask does for SDPA.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..call import FlexMask, QKCall
from .base import Kernel, add

PARAMS = (
    "query",
    "key",
    "value",
    "score_mod",
    "block_mask",
    "scale",
    "kernel_options",
    "score_mod_other_buffers",
    "mask_mod_other_buffers",
)


def _dense(num: torch.Tensor | None, indices: torch.Tensor | None, n_kv_blocks: int) -> torch.Tensor | None:
    """(B|1, H|1, QB, KB) bool block map from FlexAttention's (num_blocks, indices) pair."""
    if num is None or indices is None:
        return None
    valid = torch.arange(indices.shape[-1], device=indices.device) < num.unsqueeze(-1)  # (…, QB, KBmax)
    target = torch.where(valid, indices.long(), n_kv_blocks)
    dense = torch.zeros(*indices.shape[:-1], n_kv_blocks + 1, dtype=torch.bool, device=indices.device)
    dense.scatter_(-1, target, True)
    return dense[..., :n_kv_blocks]


def is_identity(score_mod: Any) -> bool:
    """FlexAttention's default score_mod (returns the score unchanged)."""
    return score_mod is None or getattr(score_mod, "__name__", "") in ("_identity", "identity")


def flex_mask(block_mask: tuple[Any, ...], n_kv: int, mask_args: tuple[Any, ...]) -> FlexMask:
    """The FlexMask of a ``BlockMask.as_tuple()`` for a call with `n_kv` keys."""
    items = list(block_mask)
    if items and isinstance(items[0], int):  # torch >= 2.6: (Q_LEN, KV_LEN, ...) first
        items = items[2:]
    kv_num, kv_idx, full_num, full_idx = items[:4]
    q_block, kv_block, mask_mod = int(items[-3]), int(items[-2]), items[-1]
    n_blocks = -(-n_kv // kv_block)
    partial = _dense(kv_num, kv_idx, n_blocks)
    assert partial is not None
    return FlexMask(
        q_block, kv_block, partial, _dense(full_num, full_idx, n_blocks), mask_mod, tuple(mask_args)
    )


def read_flex(a: Mapping[str, Any]) -> QKCall:
    q, k = a["query"], a["key"]  # (B, H, L, E), (B, Hkv, S, E)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"flex_attention with query {tuple(q.shape)}: expected 4-d (B, H, L, E)")
    score_mod = None if is_identity(a["score_mod"]) else a["score_mod"]
    block_mask = a["block_mask"]
    flex = (
        flex_mask(block_mask, k.shape[2], tuple(a.get("mask_mod_other_buffers") or ()))
        if block_mask
        else None
    )
    return QKCall(
        q,
        k,
        a.get("scale"),
        score_mod=score_mod,
        score_args=tuple(a.get("score_mod_other_buffers") or ()),
        flex=flex,
    )


def cap_score_mod(a: dict[str, Any], cap: float) -> None:
    """Soft-cap through FlexAttention's ``score_mod``: the cap first, then the model's own score_mod
    (a cap sits before any bias, as in Gemma 2)."""
    inner = None if is_identity(a["score_mod"]) else a["score_mod"]

    def capped(score: torch.Tensor, b: Any, h: Any, q_idx: Any, kv_idx: Any, *buffers: Any) -> torch.Tensor:
        score = cap * torch.tanh(score / cap)
        return score if inner is None else inner(score, b, h, q_idx, kv_idx, *buffers)

    capped.__stabkit_softcap__ = cap  # type: ignore[attr-defined]
    a["score_mod"] = capped


FLEX = add(
    Kernel(
        "flex_attention",
        "PyTorch FlexAttention",
        read_flex,
        ops=("higher_order::flex_attention",),
        params=PARAMS,
        cap=cap_score_mod,
        qk=("query", "key"),
    )
)
