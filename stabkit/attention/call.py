"""One attention call in a canonical form: queries and keys with everything that decides which
logits a query sees and what enters its softmax.

Built by the readers of intercepted calls (SDPA, ``nn.MultiheadAttention``, eager softmax, and the
kernels of `stabkit.attention.kernels`) inside the attention probe's handler on sampled steps, and
by discovery's traced forward (there with gradients, to follow q and k back to their projections).
A reader only binds arguments and makes views: no copy of q or k, no host sync.

Which (query i, key j) entries are *allowed* (all conditions at once):

- ``allowed``: a materialised bool mask (True = may attend), broadcastable to (B, H, L, S);
- ``causal``: top-left causal, key j <= query i (``F.scaled_dot_product_attention``);
- ``positions``: masks given by positions rather than materialised — causal in key coordinates
  (bottom-right aligned kernels), a sliding window, chunks, packed documents (``cu_seqlens``);
- ``flex``: FlexAttention's block mask (full blocks, and partial blocks through its ``mask_mod``).

What enters the softmax of an allowed entry (the *score*), in this order (Gemma 2 puts the cap
before any bias; one rule for every path): ``logit = q·k·scale`` → ``softcap·tanh(logit/softcap)``
→ ``+ bias`` (additive mask, ALiBi from ``positions``) → ``score_mod`` (FlexAttention). Learned
``sinks`` add one column per head to every row's softmax (GPT-OSS). The *max logit* is the max |logit|
over the allowed entries, before any of these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Positions:
    """Masks (and ALiBi) defined by positions, as device vectors: built without a host sync.

    A query at `q_pos` p (plus its batch row's `row_offset`) sees a key at `k_pos` j when: same
    document (when documents are given); j <= p (causal); p - left <= j <= p + right (window, -1 =
    unbounded on that side); j // chunk == p // chunk (chunks). Bottom-right aligned kernels
    (flash-attn) put query i of a call with L queries and S keys at p = i + S - L; packed documents do
    this per document, padded batch rows (Transformer Engine) per row with the row's actual lengths.
    """

    q_pos: torch.Tensor
    """(L,) int64: each query's position in key coordinates."""
    k_pos: torch.Tensor
    """(S,) int64: each key's position."""
    q_doc: torch.Tensor | None = None
    """(L,) int64 document of each query (packed sequences), or None (one document)."""
    k_doc: torch.Tensor | None = None
    """(S,) int64 document of each key."""
    causal: bool = False
    window: tuple[int, int] | None = None
    """(left, right) keys around the query's position; -1 = unbounded on that side."""
    chunk: int = 0
    """Chunk size (0: no chunks)."""
    alibi: torch.Tensor | None = None
    """(H,) or (B, H) ALiBi slopes: the score gets ``-slope · |p - j|``."""
    row_offset: torch.Tensor | None = None
    """(B,) int64 added to every query position of batch row b (bottom-right alignment by each row's
    actual lengths when rows are padded), or None."""

    @classmethod
    def aligned(
        cls, n_q: int, n_k: int, device: torch.device, *, bottom_right: bool, **masks: Any
    ) -> Positions:
        """Positions of one dense call: key j at j, query i at i (top-left) or i + S - L (bottom-right)."""
        offset = n_k - n_q if bottom_right else 0
        q_pos = torch.arange(n_q, device=device) + offset
        return cls(q_pos=q_pos, k_pos=torch.arange(n_k, device=device), **masks)

    @classmethod
    def packed(
        cls,
        cu_q: torch.Tensor,
        cu_k: torch.Tensor,
        n_q: int,
        n_k: int,
        *,
        bottom_right: bool,
        starts_q: torch.Tensor | None = None,
        starts_k: torch.Tensor | None = None,
        **masks: Any,
    ) -> Positions:
        """Positions of a packed (varlen) call from its cumulative lengths ``cu_seqlens`` (B + 1,):
        document d holds queries ``cu_q[d]:cu_q[d+1]`` and keys ``cu_k[d]:cu_k[d+1]``; positions
        restart in each document (aligned bottom-right per document when `bottom_right`).

        `starts_q` / `starts_k` (B + 1,): where each document starts when there are gaps between them
        (Transformer Engine's ``cu_seqlens_*_padded``; document d then holds tokens
        ``starts[d] : starts[d] + length[d]``). Tokens in no document (gaps, or past the last one)
        see no key and are seen by no query."""
        cu_q, cu_k = cu_q.long(), cu_k.long()
        q_doc, q_local = _documents(cu_q, cu_q if starts_q is None else starts_q.long(), n_q, outside=-1)
        k_doc, k_local = _documents(cu_k, cu_k if starts_k is None else starts_k.long(), n_k, outside=-2)
        if bottom_right:
            shift = cu_k.diff() - cu_q.diff()  # (B,)
            q_local = q_local + shift[q_doc.clamp(min=0)]
        return cls(q_pos=q_local, k_pos=k_local, q_doc=q_doc, k_doc=k_doc, **masks)

    def blocked(
        self, q_index: torch.Tensor, keys: slice, rows: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """bool (…, l, s): True where the measured queries (`q_index`, (b|1, h|1, l) indices into the
        call's queries, of batch rows `rows` (b,) when `row_offset` is set) may NOT see keys `keys`;
        None when nothing is blocked by position."""
        p = self._query_positions(q_index, rows).unsqueeze(-1)  # (…, l, 1)
        j = self.k_pos[keys]  # (s,)
        out: torch.Tensor | None = None

        def add(t: torch.Tensor) -> None:
            nonlocal out
            out = t if out is None else out | t

        if self.q_doc is not None and self.k_doc is not None:
            add(self.q_doc[q_index].unsqueeze(-1) != self.k_doc[keys])
        if self.causal:
            add(j > p)
        if self.window is not None:
            left, right = self.window
            if left >= 0:
                add(j < p - left)
            if right >= 0:
                add(j > p + right)
        if self.chunk > 0:
            add(
                torch.div(j, self.chunk, rounding_mode="floor")
                != torch.div(p, self.chunk, rounding_mode="floor")
            )
        return out

    def _query_positions(self, q_index: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """(…, l) positions of the measured queries, with their rows' `row_offset`."""
        p = self.q_pos[q_index]
        if self.row_offset is None:
            return p
        if rows is None:
            raise ValueError("positions with per-row offsets need the measured batch rows")
        return p + self.row_offset[rows].view(-1, *([1] * (p.dim() - 1)))

    def bias(
        self, q_index: torch.Tensor, keys: slice, rows: torch.Tensor, heads: torch.Tensor
    ) -> torch.Tensor | None:
        """float32 ALiBi term for (rows, heads, queries, keys) of a block, or None without ALiBi.
        `rows` (b,) and `heads` (h,) are absolute indices; `q_index` broadcasts to (b, h, l)."""
        if self.alibi is None:
            return None
        slopes = self.alibi.float()
        if slopes.dim() == 1:
            slopes = slopes[heads].view(1, -1, 1, 1)
        elif self.q_doc is not None:  # packed: one row of slopes per document
            per_query = slopes[self.q_doc[q_index]]  # (b|1, h|1, l, H)
            shape = (per_query.shape[0], heads.numel(), per_query.shape[2], per_query.shape[3])
            index = heads.view(1, -1, 1, 1).expand(shape[0], shape[1], shape[2], 1)
            slopes = per_query.expand(shape).gather(-1, index)  # (b, h, l, 1)
        else:
            slopes = slopes[rows][:, heads, None, None]
        distance = (self._query_positions(q_index, rows).unsqueeze(-1) - self.k_pos[keys]).abs().float()
        return -slopes * distance


def _documents(
    cu: torch.Tensor, starts: torch.Tensor, n: int, outside: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(n,) document of each packed position and its position in the document, from cumulative
    lengths `cu` (B + 1,) and the documents' `starts` (B + 1,; `cu` without gaps); a position in no
    document gets document `outside`."""
    index = torch.arange(n, device=cu.device)
    doc = torch.searchsorted(starts[1:].contiguous(), index, right=True)  # (n,) in [0, B]
    last = cu.numel() - 2
    local = index - starts[doc.clamp(max=last)]
    inside = (doc <= last) & (local < cu.diff()[doc.clamp(max=last)])
    return torch.where(inside, doc, outside), local


@dataclass
class FlexMask:
    """FlexAttention's block mask: which (query block, key block) pairs run fully, which run through
    `mask_mod`; every other pair is masked. Block maps are dense bools (small: blocks, not entries)."""

    q_block: int
    kv_block: int
    partial: torch.Tensor
    """(B|1, H|1, query blocks, key blocks) bool: blocks computed with `mask_mod`."""
    full: torch.Tensor | None
    """Same shape: blocks computed without `mask_mod` (None: none)."""
    mask_mod: Callable[..., torch.Tensor] | None
    """(b, h, q_idx, kv_idx) -> bool, FlexAttention's signature."""
    mask_args: tuple[Any, ...] = ()
    """Extra buffers passed after the four indices (compiled FlexAttention lifts them)."""


ScoreMod = Callable[..., torch.Tensor]
"""FlexAttention score_mod: (score, b, h, q_idx, kv_idx, *buffers) -> score."""


@dataclass
class QKCall:
    """An attention call given by its queries and keys (see the module docstring)."""

    q: torch.Tensor
    """(B, H, L, E) queries, as the model passes them (RoPE applied, any dtype)."""
    k: torch.Tensor
    """(B, Hkv, S, E) keys; Hkv divides H (GQA/MQA: query head h uses key head h // (H / Hkv))."""
    scale: float | None
    """Logit scale (None = 1/sqrt(E))."""
    allowed: torch.Tensor | None = None
    """bool, 4-d, broadcastable to (B, H, L, S): True where a query may see a key (None = everywhere)."""
    bias: torch.Tensor | None = None
    """Additive float term of the softmax input, 4-d broadcastable; masked entries may hold -inf/min."""
    causal: bool = False
    """Top-left causal mask (query i sees keys j <= i) on top of `allowed`."""
    positions: Positions | None = None
    """Position-defined masks and ALiBi (kernels' causal flags, windows, chunks, packed documents)."""
    softcap: float | None = None
    """The kernel caps its own logits: ``softcap·tanh(logit/softcap)`` before any bias."""
    sinks: torch.Tensor | None = None
    """(H,) learned sink logits: one extra softmax column per head."""
    score_mod: ScoreMod | None = None
    """FlexAttention score_mod, applied after cap and bias."""
    score_args: tuple[Any, ...] = ()
    """Extra buffers of `score_mod`."""
    flex: FlexMask | None = None
    """FlexAttention's block mask."""
    kernel: str = "sdpa"
    """What was called (for messages)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Reader-specific facts (e.g. the packed documents' count) — informational only."""

    @property
    def index_masked(self) -> bool:
        """True when masks or scores depend on indices (positions, FlexAttention) beyond `allowed`/`causal`."""
        return self.positions is not None or self.flex is not None or self.score_mod is not None


@dataclass
class LogitsCall:
    """An attention call given by its materialised softmax input (eager attention)."""

    x: torch.Tensor
    """(B, H, L, S) logits plus additive mask; entries <= finfo(dtype).min/2 are masked."""
    sink_columns: int = 0
    """The last `sink_columns` columns are learned sink logits (GPT-OSS), not q·k logits."""
    shift: torch.Tensor | None = None
    """(B, H, L, 1) what the model subtracted from each row before its softmax (its row max):
    the logits are ``x + shift`` (None: not shifted)."""
