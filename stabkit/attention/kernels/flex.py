"""FlexAttention: read at its Python entry point ``torch.nn.attention.flex_attention.flex_attention``
(made visible by `entry_points`), and at torchtitan's ``FlexAttention._compiled_flex_attn`` (the
``torch.compile`` of it torchtitan makes at import, which holds the original). Not at the
higher-order op it calls: in eager mode FlexAttention compiles that call, and a function mode seen
there would be traced by Dynamo.

The call gets query (B, H, L, E), key (B, Hkv, S, E) (``enable_gqa``), value, score_mod, a
``BlockMask`` (read through ``BlockMask.as_tuple()``: (L, S, kv_num_blocks, kv_indices,
full_kv_num_blocks, full_kv_indices, …, Q_BLOCK_SIZE, KV_BLOCK_SIZE, mask_mod)) and scale. An entry is allowed when its (query block, key block) pair is
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
    if q.shape[1] != k.shape[1] and not a.get("enable_gqa", True):
        raise ValueError("flex_attention with fewer key heads and enable_gqa=False: not measured")
    score_mod = None if is_identity(a["score_mod"]) else a["score_mod"]
    block_mask = a["block_mask"]
    if block_mask is not None and not isinstance(block_mask, tuple):
        block_mask = block_mask.as_tuple()  # the Python entry point gets a BlockMask
    mask_args = tuple(a.get("mask_mod_other_buffers") or ())
    flex = flex_mask(block_mask, k.shape[2], mask_args) if block_mask else None
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
        functions=(
            "torch.nn.attention.flex_attention:flex_attention",
            # torchtitan compiles it once at import and calls the compiled function it keeps
            "torchtitan.models.common.attention:FlexAttention._compiled_flex_attn",
        ),
        cap=cap_score_mod,
        qk=("query", "key"),
    )
)
