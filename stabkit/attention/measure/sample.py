"""Which batch rows and query positions the attention probe measures: `Sampling` (the rule) and
`Sample` (the rule applied to one call).

Runs inside the attention probe's handler (sampled steps, under ``no_grad``); no host sync.

Eager, the sample is a pair of slices (views of q, k and the masks). Under ``torch.compile`` the
round that rotates the sample (``step // attention_every``) must not be a Python value — Dynamo
would guard on it and recompile on every sampled step — so the compiled probe passes it as a 0-d
device tensor (`Sampling.counter`, `stabkit.probes.base.StepPhase.round`) and the sample is a pair
of index tensors of fixed length: the same rows and positions as the eager slices, gathered. The
number of strided positions ``len(range(offset, L, stride))`` depends on the offset (one fewer for
the last offsets when the stride does not divide L), so the compiled sample always has the largest
count and marks the slot past the end `invalid`: the measurement blocks every key of an invalid
slot, which leaves it out of the max and of the entropy's rows exactly as if it were not there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """Which batch rows and query positions to measure: deterministic, no RNG (observation only).

    `round` (the sampled-step counter) rotates the rows and the query offset, so successive
    sampled steps look at different rows/positions; `counter` is that round as a 0-d int64 device
    tensor (under torch.compile), used instead of `round` when set.
    """

    rows: int | None
    """Batch rows to measure (None = all)."""
    queries: int | None
    """Query positions to measure per row (None = all)."""
    round: int = 0
    counter: torch.Tensor | None = None
    """The round on the device (compiled probes): index tensors instead of slices (`sample`)."""

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

    def sample(self, batch: int, n_q: int, device: torch.device) -> Sample:
        """The sample of a call with `batch` rows and `n_q` queries (slices, or with `counter` index
        tensors)."""
        counter = self.counter
        if counter is None:
            queries = self.query_slice(n_q)
            return Sample(self.row_slice(batch), queries, range(n_q)[queries])
        rows: slice | torch.Tensor = slice(None)
        if self.rows is not None and self.rows < batch:
            start = (counter.to(device) * self.rows) % (batch - self.rows + 1)  # 0-d int64
            rows = start + torch.arange(self.rows, device=device)  # (b,)
        if self.queries is None or self.queries >= n_q:
            return Sample(rows, slice(None), range(n_q))
        stride = -(-n_q // self.queries)
        count = len(range(0, n_q, stride))  # the most any offset gives
        offset = counter.to(device) % stride  # 0-d int64
        index = offset + stride * torch.arange(count, device=device)  # (l,)
        # host bound of each slot's position (the largest offset), for skipping causal key blocks
        bound = range(stride - 1, stride - 1 + stride * count, stride)
        if bound[-1] < n_q:  # every offset fills every slot
            return Sample(rows, index, bound)
        invalid = index >= n_q  # (l,) the last slot, for offsets that give one fewer position
        return Sample(rows, index.clamp(max=n_q - 1), bound, invalid)


EXACT = Sampling(None, None)


@dataclass(frozen=True)
class Sample:
    """The measured rows and query positions of one call (slices eager, index tensors compiled)."""

    rows: slice | torch.Tensor
    """Batch rows: a slice, or (b,) int64 indices."""
    queries: slice | torch.Tensor
    """Query positions: a slice, or (l,) int64 indices."""
    positions: range
    """Host positions of the measured queries (compiled: an upper bound of each), so that causal key
    blocks after every query are skipped without a sync."""
    invalid: torch.Tensor | None = None
    """(l,) bool: query slots past the end of the call (compiled sample only; None: none)."""

    def take(self, t: torch.Tensor, queries: bool = True) -> torch.Tensor:
        """Slice a (B, H, L, ...) tensor, or one broadcastable to it (size-1 dims stay whole), to the
        sample (`queries` False: rows only). A view eagerly, a gathered copy under compile."""
        if t.shape[0] > 1:
            t = t[self.rows] if isinstance(self.rows, slice) else t.index_select(0, self.rows)
        if queries and t.shape[2] > 1:
            q = self.queries
            t = t[:, :, q] if isinstance(q, slice) else t.index_select(2, q)
        return t

    def query_index(self, n_q: int, device: torch.device) -> torch.Tensor:
        """(l,) int64 index of each measured query in the call."""
        q = self.queries
        return torch.arange(n_q, device=device)[q] if isinstance(q, slice) else q

    def row_index(self, batch: int, device: torch.device) -> torch.Tensor:
        """(b,) int64 absolute batch row of each measured row."""
        r = self.rows
        return torch.arange(batch, device=device)[r] if isinstance(r, slice) else r
