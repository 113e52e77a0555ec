"""Attention-logit statistics, one block of logits at a time: max |logit|, and the entropy of each
query row by an online log-sum-exp over its key blocks (the row/query sample: `stabkit.attention.measure.sample`,
re-exported here).

Runs inside the attention probe's handler, i.e. inside the attention module's forward on sampled
steps, under ``torch.no_grad()`` in float32. Everything stays on the device (no host sync).

Definitions (one attention call, on the measured rows and query positions):

- a *logit* is ``q·kᵀ·scale`` at a (batch row, head, query, key) entry the mask allows;
- ``max_logit`` of a head: max |logit| over its allowed entries (NaN/Inf propagate);
- the *entropy* of a query row: ``-Σ p log p`` of the attention distribution over its allowed keys
  (``p = softmax(logit + additive bias)``; with a soft cap, of the capped logits); query rows with no
  allowed key are left out;
- ``entropy`` of a head: the mean over its measured query rows;
- the *first-key mass* of a query row: its softmax probability on key 0 (``exp(z₀ − log Σ e^z)``, 0
  when key 0 is masked for it); of a head: the mean over its measured rows. Gu et al. (ICLR 2025)
  count a head whose mean first-key mass exceeds 0.3 as a *sink head* (`SINK_HEAD`).

With ``z`` the softmax input of a row and ``m`` a reference (its running max), the entropy is
``log Σe − Σ e·(z − m) / Σe`` with ``e = exp(z − m)``; `RowSums` keeps ``Σe`` and ``Σ e·(z − m)``
per row and rescales both when a later key block raises the max, so the keys can come in blocks
of any size and the result equals the one-block computation to float rounding. Shifted logits are
clamped at −80, as in a one-block computation: keys that far below the max weigh < 1e-34.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .sample import EXACT, Sample, Sampling

__all__ = [
    "CLAMP",
    "EXACT",
    "SINK_HEAD",
    "HeadStats",
    "RowSums",
    "Sample",
    "Sampling",
    "fill_",
    "masked_absmax",
    "softmax_input",
    "uncap",
]

SINK_HEAD = 0.3
"""Gu et al. (ICLR 2025): a head is a sink head when its mean attention on the first key (with
learned sink logits: on the sinks) exceeds this."""

CLAMP = -80.0
"""Lowest shifted logit ``z − max`` that enters the sums (exp stays a normal float32)."""


@dataclass
class HeadStats:
    """Per-head sums of one attention call (device tensors, float32) — or of several calls with the
    same heads, stacked along a leading dim (`stacked`): the summaries below reduce over the last
    (head) dim, so they give one value per call (shapes say (H,) for one call)."""

    max_logit: torch.Tensor
    """(H,) max |logit| over the allowed entries of each head."""
    entropy_sum: torch.Tensor
    """(H,) sum of the entropies of the measured query rows of each head."""
    rows: torch.Tensor
    """(H,) number of measured query rows (with at least one allowed key) of each head."""
    first_sum: torch.Tensor | None = None
    """(H,) sum over the measured rows of the probability on key 0 (None: not measured)."""
    sink_sum: torch.Tensor | None = None
    """(H,) sum over the measured rows of the probability on learned sink logits (None: no sinks)."""

    @classmethod
    def zeros(cls, heads: int, device: torch.device) -> HeadStats:
        """Nothing measured yet (max 0: |logit| >= 0, and a head without allowed entries reads 0)."""
        return cls(*(torch.zeros(heads, device=device) for _ in range(4)))

    @classmethod
    def stacked(cls, calls: list[HeadStats]) -> HeadStats:
        """The sums of `calls` (the same heads; all with or all without first and sink sums) as one
        HeadStats of (C, H) tensors, in order."""

        def stack(field: str) -> torch.Tensor | None:
            parts = [getattr(c, field) for c in calls]
            return None if parts[0] is None else torch.stack(parts)

        max_logit, entropy_sum, rows = (stack(f) for f in ("max_logit", "entropy_sum", "rows"))
        assert max_logit is not None and entropy_sum is not None and rows is not None
        return cls(max_logit, entropy_sum, rows, stack("first_sum"), stack("sink_sum"))

    def sink_mass(self) -> torch.Tensor | None:
        """(H,) mean probability on the sink logits per head (None without sinks)."""
        return None if self.sink_sum is None else self.sink_sum / self.rows.clamp_min(1)

    def first_key_mass(self) -> torch.Tensor:
        """(H,) mean probability on key 0 per head (0 for a head without measured rows)."""
        first = self.first_sum if self.first_sum is not None else torch.zeros_like(self.rows)
        return first / self.rows.clamp_min(1)

    def attention_sinks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """0-d (sink-head fraction, largest per-head mass): the mass is the first-key mass, or with
        learned sink logits the sinks' mass; a sink head's mass exceeds `SINK_HEAD` (Gu et al.)."""
        sink = self.sink_mass()
        mass = self.first_key_mass() if sink is None else sink  # (H,)
        return (mass > SINK_HEAD).float().mean(dim=-1), mass.amax(dim=-1)

    def entropy(self) -> torch.Tensor:
        """0-d mean entropy over all heads' measured rows."""
        return self.entropy_sum.sum(dim=-1) / self.rows.sum(dim=-1).clamp_min(1)

    def head_entropy(self) -> torch.Tensor:
        """(H,) mean entropy of each head (0 for a head without measured rows)."""
        return self.entropy_sum / self.rows.clamp_min(1)

    def min_head_entropy(self) -> torch.Tensor:
        """0-d min over heads (with measured rows) of the per-head mean entropy."""
        per_head = torch.where(self.rows > 0, self.head_entropy(), torch.inf)
        low = per_head.amin(dim=-1)
        return torch.where(torch.isinf(low) & (low > 0), torch.zeros_like(low), low)


def fill_(t: torch.Tensor, blocked: torch.Tensor, value: float) -> torch.Tensor:
    """In place: `value` at the `blocked` entries of `t` (broadcast); faster than masked_fill_ on a CPU.
    The 0-d fill is made on the device (``new_full``: no host-to-device copy, no sync)."""
    return torch.where(blocked, t.new_full((), value), t, out=t)


def masked_absmax(logits: torch.Tensor, blocked: torch.Tensor | None) -> torch.Tensor:
    """(h,) max |logit| over the allowed entries of a (b, h, l, s) block, per head (NaN propagates).

    Writes 0 into `logits` at blocked entries (the block is the caller's own temporary)."""
    if blocked is not None:
        fill_(logits, blocked, 0.0)
    return torch.maximum(logits.amax(dim=(0, 2, 3)), -logits.amin(dim=(0, 2, 3)))


def softmax_input(
    logits: torch.Tensor,
    blocked: torch.Tensor | None,
    bias: torch.Tensor | None,
    cap: float | None,
    modify: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """In place where possible: ``modify(cap·tanh(logits/cap) + bias)``, −inf at blocked entries."""
    if cap is not None:
        logits.div_(cap).tanh_().mul_(cap)
    if bias is not None:
        logits.add_(bias)
    if modify is not None:
        logits = modify(logits).to(torch.float32).contiguous()
    if blocked is not None:
        fill_(logits, blocked, -torch.inf)
    return logits


class RowSums:
    """Running softmax sums of a block of query rows, (b, h, l), over the key blocks added so far."""

    def __init__(self) -> None:
        self.top: torch.Tensor | None = None
        """(b, h, l) running max of the softmax input (−inf: no allowed key yet; NaN propagates)."""
        self.total = torch.zeros(())
        """Σ exp(z − ref), ref = top where finite, else 0."""
        self.moment = torch.zeros(())
        """Σ exp(z − ref)·(z − ref)."""

    def add(self, z: torch.Tensor) -> None:
        """Add a (b, h, l, s) block of softmax inputs (−inf at masked keys); `z` is overwritten."""
        block_top = z.amax(dim=-1)
        top = block_top if self.top is None else torch.maximum(self.top, block_top)
        ref = torch.where(top == -torch.inf, 0.0, top)  # a finite reference for rows with no key yet
        shifted = z.sub_(ref.unsqueeze(-1)).clamp_min_(CLAMP)
        e = torch.exp(shifted)
        total = e.sum(dim=-1)
        moment = e.mul_(shifted).sum(dim=-1)
        if self.top is None:
            self.top, self.total, self.moment = top, total, moment
            return
        # the sums so far, moved from the old reference to the new one (delta <= 0):
        # Σ e^(z − ref) = scale·Σ e^(z − old), Σ e^(z − ref)(z − ref) = scale·(Σ e^(z − old)(z − old) + delta·Σ e^(z − old))
        delta = (self.top - ref).clamp_min(CLAMP)
        scale = torch.exp(delta)
        self.moment = scale * (self.moment + delta * self.total) + moment
        self.total = scale * self.total + total
        self.top = top

    @property
    def shape(self) -> tuple[int, ...]:
        """(b, h, l) of the rows."""
        assert self.top is not None, "RowSums.shape before any key block"
        return tuple(self.top.shape)

    def share(self, z: torch.Tensor) -> torch.Tensor:
        """Softmax probability of a score `z` ((b, h, l) or (b, h, l, n), summed over n) that was
        added to these rows (e.g. a learned sink column): ``exp(z − ref) / Σ``; 0 for rows with no key."""
        assert self.top is not None, "RowSums.share before any key block"
        ref = torch.where(self.top == -torch.inf, 0.0, self.top)
        if z.dim() == ref.dim() + 1:
            p = torch.exp((z - ref.unsqueeze(-1)).clamp_min(CLAMP)).sum(-1)
        else:
            p = torch.exp((z - ref).clamp_min(CLAMP))
        return torch.where(self.top != -torch.inf, p / self.total, 0.0)

    def entropy(self) -> tuple[torch.Tensor, torch.Tensor]:
        """((b, h, l) entropy of each row, 0 where no key was allowed; (b, h, l) bool: row counted)."""
        assert self.top is not None, "RowSums.entropy before any key block"
        valid = self.top != -torch.inf  # NaN rows count (and propagate)
        value = self.total.log() - self.moment / self.total
        return torch.where(valid, value, 0.0), valid


def uncap(capped_max: torch.Tensor, cap: float) -> torch.Tensor:
    """Invert ``cap·tanh(x/cap)`` for a max of capped logits: exact up to float32 rounding while
    |x| < ~8·cap; a lower bound beyond (tanh saturates to 1 in float32)."""
    y = (capped_max / cap).clamp(max=1.0 - 2.0**-24)
    return cap * torch.atanh(y)
