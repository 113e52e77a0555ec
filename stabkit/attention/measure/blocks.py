"""Blocks of attention logits that fit a memory budget: the plan, and one block's logits and mask.

Used by `stabkit.attention.measure.measure` inside the attention probe's handler (sampled steps, ``no_grad``).
A block is (batch rows, kv heads — with all the query heads that share them —, queries, keys);
`plan` halves the rows, then the kv heads, then the larger of queries and keys, until the block's
estimated temporaries (`cost_qk`, `cost_logits`, `cost_scores`, bytes) fit the budget
(`MonitorConfig.attn_chunk_bytes`). A budget below the smallest block (one row, one kv head, one
query, one key) is exceeded by that block: the plan never stops the measurement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ...stats.reductions import row_norms_f32

if TYPE_CHECKING:
    from ..call import QKCall
    from .masks import IndexMask

Dims = tuple[int, int, int, int]
"""(batch rows, kv heads (or heads), queries, keys) of a block or of the whole sweep."""

LOGIT_BYTES = 10
"""Live bytes per logit of a block: the float32 logits, their exponentials, the bool mask and its
combination (bool) — the block's other work is done in place."""
ROW_BYTES = 48
"""Live bytes per query row of the online entropy (`RowSums`: three sums and their updates)."""


def cost_qk(b: int, kv: int, n_q: int, n_k: int, *, group: int, dim: int, state: bool, extra: int = 0) -> int:
    """Bytes a q/k block may hold: logits, the float32 copies of its queries and keys (a cast, or
    matmul flattening strided batch dims), and (`state`) the running sums of its query rows."""
    heads = kv * group
    rows = b * heads * n_q
    out = (LOGIT_BYTES + extra) * rows * n_k + 4 * rows * dim + 4 * b * kv * n_k * dim
    return out + (ROW_BYTES * rows if state else 0)


def cost_logits(b: int, h: int, n_q: int, n_k: int, *, itemsize: int, state: bool) -> int:
    """Bytes a block of materialised logits (eager softmax input) may hold: its float32 copy, the
    exponentials and masks (`state`), or its magnitude and mask (max only)."""
    n = b * h * n_q * n_k
    if not state:
        return (itemsize + 2) * n
    return LOGIT_BYTES * n + ROW_BYTES * b * h * n_q


def cost_scores(b: int, kv: int, *, group: int, n_q: int, n_k: int, per_row: int, dim: int) -> int:
    """Bytes of scoring max candidates for `b` rows × `kv` kv heads: query norms and their scores,
    key norms with their prefix max (values and int64 indices), the top-k and the chosen queries."""
    heads = kv * group
    return b * (12 * heads * n_q + 24 * kv * n_k + 8 * kv * n_q + heads * per_row * (16 + 4 * dim))


def plan(dims: Dims, cost: Callable[[int, int, int, int], int], budget: int) -> Dims:
    """Block sizes (each between 1 and its dim) whose `cost` fits `budget` bytes: halve the rows,
    then the kv heads, then the larger of queries and keys (ties: queries), while it does not fit."""
    sizes = list(dims)
    while cost(*sizes) > budget:
        b, kv, n_q, n_k = sizes
        if b > 1:
            i = 0
        elif kv > 1:
            i = 1
        elif n_q > 1 and n_q >= n_k:
            i = 2
        elif n_k > 1:
            i = 3
        elif n_q > 1:
            i = 2
        else:
            break
        sizes[i] = -(-sizes[i] // 2)
    return sizes[0], sizes[1], sizes[2], sizes[3]


def dims_of(t: torch.Tensor) -> Dims:
    """The four dims of a 4-d tensor, typed as `Dims`."""
    b, h, n_q, n_k = t.shape
    return b, h, n_q, n_k


def spans(n: int, size: int) -> list[slice]:
    """Consecutive slices of `size` (the last one shorter) covering range(n)."""
    return [slice(i, min(i + size, n)) for i in range(0, n, max(1, size))]


def qk_logits(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    """(b, H, l, s) float32 ``q·kᵀ·scale`` of (b, H, l, E) queries and (b, Hkv, s, E) keys (query head
    h uses kv head h // (H / Hkv); scale None = 1/√E), in its own storage."""
    b, heads, n_q, dim = q.shape
    kv, n_k = k.shape[1], k.shape[2]
    scale = dim**-0.5 if scale is None else scale
    # dense float32 operands (counted by `cost_qk`): torch.matmul would copy strided ones itself
    # (a (B, T, H, E) projection seen as (B, H, T, E)), about twice as slowly on a CPU
    flat = torch.empty(q.shape, device=q.device)  # (b, H, l, E) dense float32: the scaled queries
    if q.dtype == torch.float32:
        torch.mul(q, scale, out=flat)  # one pass, whatever q's layout
    else:  # cast first: the product in float32, as for float32 queries
        flat.copy_(q).mul_(scale)
    keys = k.float().contiguous()  # (b, hkv, s, E)
    # (b·hkv, g·l, E) @ (b·hkv, E, s): the queries of a kv head's group against its keys
    out = torch.bmm(flat.view(b * kv, heads // kv * n_q, dim), keys.view(b * kv, n_k, dim).transpose(1, 2))
    return out.view(b, heads, n_q, n_k)


def candidate_reach(call: QKCall, n_q: int, n_k: int) -> torch.Tensor | None:
    """(L,) the last key each query may see under a plain causal mask (top-left, or bottom-right
    without documents or per-row offsets), for ranking max candidates; None when any key may be in
    reach."""
    device = call.q.device
    if call.causal:
        return torch.arange(n_q, device=device).clamp(max=n_k - 1)
    pos = call.positions
    if pos is not None and pos.causal and pos.q_doc is None and pos.row_offset is None:
        return pos.q_pos.clamp(0, n_k - 1)
    return None


def top_candidates(
    q: torch.Tensor, k: torch.Tensor, reach: torch.Tensor | None, per_row: int
) -> torch.Tensor:
    """(b, H, m) the `per_row` queries of each (row, head) of (b, H, L, E) `q` with the largest bound
    ‖q‖ · (largest norm of a key of (b, Hkv, S, E) `k` in `reach` (`candidate_reach`; None: any))."""
    n_q, group = q.shape[2], q.shape[1] // k.shape[1]
    score = row_norms_f32(q).contiguous()  # (b, H, L)
    key_norm = row_norms_f32(k)  # (b, Hkv, S)
    if reach is not None:
        limit = key_norm.cummax(dim=-1).values.index_select(-1, reach)  # (b, Hkv, L)
    else:
        limit = key_norm.amax(dim=-1, keepdim=True)  # (b, Hkv, 1)
    score = score.view(score.shape[0], -1, group, n_q).mul_(limit.unsqueeze(2)).flatten(1, 2)
    return score.topk(per_row, dim=-1).indices


def pick_queries(q: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """(b, h, m, E) the queries `idx` (b, h, m) of each (row, head) of (b, h, L, E) `q` (any strides,
    nothing copied but the picked rows): advanced indexing, ~1.5× faster on a CPU than ``gather``
    with an index expanded over E."""
    b, h = q.shape[0], q.shape[1]
    rows = torch.arange(b, device=q.device).view(b, 1, 1)
    heads = torch.arange(h, device=q.device).view(1, h, 1)
    return q[rows, heads, idx]


def _rows(t: torch.Tensor, part: slice) -> torch.Tensor:
    """Batch rows `part` of `t` (a size-1 batch dim broadcasts and stays whole)."""
    return t if t.shape[0] == 1 else t[part]


def _heads(t: torch.Tensor, part: slice) -> torch.Tensor:
    """Heads `part` of a 4-d `t` (a size-1 head dim broadcasts and stays whole)."""
    return t if t.shape[1] == 1 else t[:, part]


@dataclass
class QKBlocks:
    """Queries, keys and masks of one sweep (views); hands out one block's logits, mask and scores."""

    q: torch.Tensor
    """(b, H, l, E) the queries measured (any dtype)."""
    k: torch.Tensor
    """(b, Hkv, S, E) keys; Hkv divides H (query head h uses kv head h // (H / Hkv))."""
    scale: float | None
    """Logit scale (None = 1/sqrt(E))."""
    allowed: torch.Tensor | None
    """bool, 4-d, broadcastable: True where a query may see a key; its query dim is that of `q`,
    or (with `gather`) the call's full query dim."""
    bias: torch.Tensor | None
    """Additive term of the softmax input, broadcastable to (b, H, l, S)."""
    q_index: torch.Tensor
    """(b|1, H|1, l) int64: each measured query's index in the call."""
    causal: bool = False
    """Top-left causal: key j is blocked for a query at index i when j > i."""
    gather: bool = False
    """`allowed` spans the call's queries: pick the measured ones by `q_index` (the max candidates)."""
    host_positions: range | None = None
    """Causal, with the same positions for every row and head (the uniform sample): them, on the
    host, so that blocks of keys all after their queries are skipped without a device sync."""
    row_index: torch.Tensor | None = None
    """(b,) int64 absolute batch rows of the measured rows (index masks need them)."""
    index_mask: IndexMask | None = None
    """Position / FlexAttention masks, ALiBi and score_mod of the call (None: none)."""
    head_offset: int = 0
    """Absolute index of the first query head in `q` (the max candidates measure a slice of heads)."""
    q_invalid: torch.Tensor | None = None
    """(l,) bool: measured query slots that are not queries of the call (a compiled sample's slot past
    the end, `stabkit.attention.measure.sample.Sample.invalid`): every key is blocked for them."""

    def last_query(self, qs: slice) -> int:
        """The position of the last query in `qs` (needs `host_positions`)."""
        assert self.host_positions is not None
        return self.host_positions[qs][-1]

    @property
    def rows(self) -> int:
        return max(self.q.shape[0], self.k.shape[0])

    @property
    def group(self) -> int:
        """Query heads per kv head."""
        return self.q.shape[1] // self.k.shape[1]

    def logits(self, rs: slice, kv: slice, qs: slice, ks: slice) -> torch.Tensor:
        """(b, h, l, s) float32 ``q·kᵀ·scale`` of a block of rows, kv heads (with their query
        heads), queries and keys, in its own storage (the caller may write into it)."""
        group = self.group
        q = _rows(self.q, rs)[:, kv.start * group : kv.stop * group, qs]  # (b, h, l, E)
        k = _rows(self.k, rs)[:, kv, ks]  # (b, hkv, s, E)
        return qk_logits(q, k, self.scale)

    def _query_index(self, rs: slice, hs: slice, qs: slice) -> torch.Tensor:
        return _heads(_rows(self.q_index, rs), hs)[:, :, qs]  # (b|1, h|1, l)

    def _abs(self, rs: slice, hs: slice) -> tuple[torch.Tensor, torch.Tensor]:
        """Absolute (rows, heads) of a block, for index masks."""
        assert self.row_index is not None, "index masks need row_index"
        off = self.head_offset
        return self.row_index[rs], torch.arange(hs.start + off, hs.stop + off, device=self.q.device)

    def blocked(self, rs: slice, hs: slice, qs: slice, ks: slice) -> torch.Tensor | None:
        """bool, broadcastable to the block: True where a query may NOT see a key (None: all may)."""
        out: torch.Tensor | None = None
        if self.allowed is not None:
            a = _heads(_rows(self.allowed, rs), hs)
            a = a[..., ks] if a.shape[3] > 1 else a
            if a.shape[2] > 1 and self.gather:
                idx = self._query_index(rs, hs, qs)  # (b, h, l)
                a = a.expand(idx.shape[0], idx.shape[1], -1, -1)
                a = a.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, a.shape[3]))  # (b, h, l, s)
            elif a.shape[2] > 1:
                a = a[:, :, qs]
            out = ~a
        if self.q_invalid is not None:
            gone = self.q_invalid[qs].view(1, 1, -1, 1)  # (1, 1, l, 1)
            out = gone if out is None else out | gone
        if self.causal or self.index_mask is not None:
            qi = self._query_index(rs, hs, qs)
            if self.causal:
                keys = torch.arange(ks.start, ks.stop, device=qi.device)  # (s,)
                late = keys > qi.unsqueeze(-1)  # key after the query
                out = late if out is None else out | late
            if self.index_mask is not None:
                rows, heads = self._abs(rs, hs)
                extra = self.index_mask.blocked(rows, heads, qi, ks)
                if extra is not None:
                    out = extra if out is None else out | extra
        return out

    def bias_block(self, rs: slice, hs: slice, qs: slice, ks: slice) -> torch.Tensor | None:
        """The additive bias of a block (float32, broadcastable): the call's mask bias and ALiBi, or None."""
        out: torch.Tensor | None = None
        if self.bias is not None:
            t = _heads(_rows(self.bias, rs), hs)
            t = t[:, :, qs] if t.shape[2] > 1 else t
            t = t[..., ks] if t.shape[3] > 1 else t
            out = t.float()
        if self.index_mask is not None:
            rows, heads = self._abs(rs, hs)
            alibi = self.index_mask.bias(rows, heads, self._query_index(rs, hs, qs), ks)
            if alibi is not None:
                out = alibi if out is None else out + alibi
        return out

    def modifier(
        self, rs: slice, hs: slice, qs: slice, ks: slice
    ) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """FlexAttention's score_mod for this block, or None."""
        mask = self.index_mask
        if mask is None or mask.score_mod is None:
            return None
        rows, heads = self._abs(rs, hs)
        qi = self._query_index(rs, hs, qs)
        return lambda scores: mask.modify(scores, rows, heads, qi, ks)
