"""Masks and score changes that depend on indices — a kernel's causal flag, window, chunks, packed
documents, ALiBi, FlexAttention's block mask and score_mod — evaluated for one block of measured
entries at a time.

Runs inside the attention probe's handler (sampled steps, ``no_grad``), called by `QKBlocks` for each
block of (batch rows, heads, queries, keys): indices in, device tensors out, no host sync. Rows and
heads are absolute indices into the call; queries are given by their absolute index per (row, head)
(the uniform sample and the max candidates measure different queries).

FlexAttention's ``mask_mod`` / ``score_mod`` are written for scalar indices; they are called here on
broadcast index tensors (b, 1, 1, 1), (1, h, 1, 1), (b|1, h|1, l, 1), (1, 1, 1, s) — which every
elementwise or indexing mod handles — and, if that fails or gives another shape, through
``torch.vmap`` over the flattened entries, as FlexAttention's own reference path does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..call import FlexMask, Positions, QKCall


def _call_mod(
    fn: Callable[..., torch.Tensor], shape: tuple[int, ...], *inputs: Any, extra: tuple[Any, ...]
) -> torch.Tensor:
    """`fn(*inputs, *extra)` broadcast over `shape` (b, h, l, s): directly, else vmapped per entry."""
    try:
        out = fn(*inputs, *extra)
        if isinstance(out, torch.Tensor) and torch.broadcast_shapes(out.shape, shape) == shape:
            return out.expand(shape)
    except Exception:  # a mod written for scalars only: vmap it below
        pass
    flat = [torch.broadcast_to(x, shape).reshape(-1) for x in inputs]
    mapped = torch.vmap(fn, in_dims=(0,) * len(flat) + (None,) * len(extra))
    return mapped(*flat, *extra).reshape(shape)


class IndexMask:
    """The index-defined parts of one call's masks and scores (see the module docstring)."""

    def __init__(self, call: QKCall) -> None:
        self.positions: Positions | None = call.positions
        self.flex: FlexMask | None = call.flex
        self.score_mod = call.score_mod
        self.score_args = call.score_args

    @staticmethod
    def of(call: QKCall) -> IndexMask | None:
        return IndexMask(call) if call.index_masked else None

    @property
    def bytes_per_logit(self) -> int:
        """Extra temporaries per logit of a block, for the memory plan."""
        extra = 0
        if self.positions is not None:
            extra += 4 + (16 if self.positions.alibi is not None else 0)
        if self.flex is not None or self.score_mod is not None:
            extra += 48  # broadcast / vmapped index tensors and the mod's own temporaries
        return extra

    def blocked(
        self, rows: torch.Tensor, heads: torch.Tensor, q_index: torch.Tensor, keys: slice
    ) -> torch.Tensor | None:
        """bool, broadcastable to (b, h, l, s): True where a measured query may NOT see a key."""
        out = self.positions.blocked(q_index, keys, rows) if self.positions is not None else None
        if self.flex is not None:
            flex = ~self._flex_allowed(rows, heads, q_index, keys)
            out = flex if out is None else out | flex
        return out

    def bias(
        self, rows: torch.Tensor, heads: torch.Tensor, q_index: torch.Tensor, keys: slice
    ) -> torch.Tensor | None:
        """The ALiBi term of a block (float32), or None."""
        return self.positions.bias(q_index, keys, rows, heads) if self.positions is not None else None

    def modify(
        self,
        scores: torch.Tensor,
        rows: torch.Tensor,
        heads: torch.Tensor,
        q_index: torch.Tensor,
        keys: slice,
    ) -> torch.Tensor:
        """FlexAttention's score_mod on a (b, h, l, s) block of scores (returned as is without one)."""
        if self.score_mod is None:
            return scores
        b, h, q, kv = self._indices(rows, heads, q_index, keys, scores.device)
        out = _call_mod(self.score_mod, tuple(scores.shape), scores, b, h, q, kv, extra=self.score_args)
        return out.to(scores.dtype)

    @staticmethod
    def _indices(
        rows: torch.Tensor, heads: torch.Tensor, q_index: torch.Tensor, keys: slice, device: torch.device
    ) -> tuple[torch.Tensor, ...]:
        b = rows.view(-1, 1, 1, 1)
        h = heads.view(1, -1, 1, 1)
        q = q_index.unsqueeze(-1)  # (b|1, h|1, l, 1)
        kv = torch.arange(keys.start, keys.stop, device=device).view(1, 1, 1, -1)
        return b, h, q, kv

    def _flex_allowed(
        self, rows: torch.Tensor, heads: torch.Tensor, q_index: torch.Tensor, keys: slice
    ) -> torch.Tensor:
        flex = self.flex
        assert flex is not None
        b, h, q, kv = self._indices(rows, heads, q_index, keys, q_index.device)
        shape = (b.shape[0], h.shape[1], q.shape[2], kv.shape[3])
        pb = b if flex.partial.shape[0] > 1 else torch.zeros_like(b)
        ph = h if flex.partial.shape[1] > 1 else torch.zeros_like(h)
        qb = torch.div(q, flex.q_block, rounding_mode="floor")
        kb = torch.div(kv, flex.kv_block, rounding_mode="floor")
        partial = flex.partial[pb, ph, qb, kb]  # (b, h, l, s)
        full = flex.full[pb, ph, qb, kb] if flex.full is not None else None
        if flex.mask_mod is not None:
            partial = partial & _call_mod(flex.mask_mod, shape, b, h, q, kv, extra=flex.mask_args).bool()
        return partial if full is None else partial | full
