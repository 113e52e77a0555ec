"""Attention-logit statistics on materialised logits: max |logit|, entropy per head, row/query sampling.

Runs inside the attention probe's handler, i.e. inside the attention module's forward on sampled
steps, under ``torch.no_grad()`` in float32. Everything stays on the device (no host sync).

Definitions (one attention call, on the measured rows and query positions):

- a *logit* is ``q·kᵀ·scale`` at a (batch row, head, query, key) entry the mask allows;
- ``max_logit`` of a head: max |logit| over its allowed entries (NaN/Inf propagate);
- the *entropy* of a query row: ``-Σ p log p`` of the attention distribution over its allowed keys
  (``p = softmax(logit + additive bias)``; with a soft cap, of the capped logits); query rows with no
  allowed key are left out;
- ``entropy`` of a head: the mean over its measured query rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """Which batch rows and query positions to measure: deterministic, no RNG (observation only).

    `round` (the sampled-step counter) rotates the rows and the query offset, so successive
    sampled steps look at different rows/positions.
    """

    rows: int | None
    """Batch rows to measure (None = all)."""
    queries: int | None
    """Query positions to measure per row (None = all)."""
    round: int = 0

    def row_slice(self, n: int) -> slice:
        """`rows` consecutive batch rows out of `n` (all when `rows` is None or >= n)."""
        if self.rows is None or self.rows >= n:
            return slice(None)
        start = (self.round * self.rows) % (n - self.rows + 1)
        return slice(start, start + self.rows)

    def query_slice(self, n: int) -> slice:
        """At most `queries` positions out of `n`, evenly strided, offset rotating with `round`."""
        if self.queries is None or self.queries >= n:
            return slice(None)
        stride = -(-n // self.queries)  # ceil
        return slice(self.round % stride, n, stride)


EXACT = Sampling(None, None)


def take(t: torch.Tensor, rows: slice, queries: slice) -> torch.Tensor:
    """Slice a (B, H, L, ...) tensor, or one broadcastable to it (size-1 dims stay whole), to the sample."""
    r = rows if t.shape[0] > 1 else slice(None)
    q = queries if t.shape[2] > 1 else slice(None)
    return t[r, :, q]


def causal_allowed(positions: slice, n_queries: int, n_keys: int, device: torch.device) -> torch.Tensor:
    """(1, 1, l, S) bool: True where the query at its original position i may see key j (j <= i, top-left)."""
    q_idx = torch.arange(n_queries, device=device)[positions]  # (l,)
    k_idx = torch.arange(n_keys, device=device)  # (S,)
    return (k_idx[None, :] <= q_idx[:, None])[None, None]


@dataclass
class HeadStats:
    """Per-head sums of one attention call (device tensors, float32)."""

    max_logit: torch.Tensor
    """(H,) max |logit| over the allowed entries of each head."""
    entropy_sum: torch.Tensor
    """(H,) sum of the entropies of the measured query rows of each head."""
    rows: torch.Tensor
    """(H,) number of measured query rows (with at least one allowed key) of each head."""

    def entropy(self) -> torch.Tensor:
        """0-d mean entropy over all heads' measured rows."""
        return self.entropy_sum.sum() / self.rows.sum().clamp_min(1)

    def head_entropy(self) -> torch.Tensor:
        """(H,) mean entropy of each head (0 for a head without measured rows)."""
        return self.entropy_sum / self.rows.clamp_min(1)

    def min_head_entropy(self) -> torch.Tensor:
        """0-d min over heads (with measured rows) of the per-head mean entropy."""
        per_head = torch.where(self.rows > 0, self.head_entropy(), torch.inf)
        low = per_head.amin()
        return torch.where(torch.isinf(low) & (low > 0), torch.zeros_like(low), low)


def head_stats(
    logits: torch.Tensor,
    allowed: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    cap: float | None = None,
) -> HeadStats:
    """Statistics of logits (B, H, L, S) float32.

    `allowed`: bool, broadcastable to the logits, True where the mask lets a query see a key (None = all).
    `bias`: additive float term of the softmax input (e.g. an additive mask), broadcastable; it enters
    the entropy, not `max_logit`. `cap`: soft cap ``cap·tanh(x/cap)`` applied to the logits before the
    softmax (entropy only: `max_logit` is the raw value).
    """
    mag = logits.abs()  # (B, H, L, S)
    if allowed is not None:
        mag = torch.where(allowed, mag, 0.0)  # NaN at allowed entries propagates
    z = logits if cap is None else cap * torch.tanh(logits / cap)
    if bias is not None:
        z = z + bias
    if allowed is not None:
        z = torch.where(allowed, z, -torch.inf)
    top = z.amax(dim=-1, keepdim=True)  # (B, H, L, 1); -inf: the row has no allowed key
    valid = top.squeeze(-1) != -torch.inf  # (B, H, L); NaN rows count (and propagate)
    # shifted logits clamped at -80: exp stays normal (fast); keys that far below the max weigh < 1e-34
    shifted = (z - top).clamp_min(-80.0)
    e = torch.exp(shifted)
    total = e.sum(dim=-1)  # (B, H, L), >= 1 on valid rows
    # entropy = log Σe − Σ e·shifted / Σe   (e = exp(z − max))
    row_entropy = torch.where(valid, total.log() - (e * shifted).sum(dim=-1) / total, 0.0)
    head_max = mag.amax(dim=(0, 2, 3))  # (H,)
    return HeadStats(head_max, row_entropy.sum(dim=(0, 2)), valid.sum(dim=(0, 2)).float())


def uncap(capped_max: torch.Tensor, cap: float) -> torch.Tensor:
    """Invert ``cap·tanh(x/cap)`` for a max of capped logits: exact up to float32 rounding while
    |x| < ~8·cap; a lower bound beyond (tanh saturates to 1 in float32)."""
    y = (capped_max / cap).clamp(max=1.0 - 2.0**-24)
    return cap * torch.atanh(y)
