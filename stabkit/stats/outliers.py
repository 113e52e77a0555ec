"""Massive activations and outlier features of one hidden state, as float32 0-d device tensors.

Called by the activation probe on block outputs (the residual stream) on sampled steps, inside a
forward hook (eager), or inside the opaque op ``torch.ops.stabkit.outlier_stats`` (compiled: the same
code). No host sync.

Definitions, for a hidden state ``x`` of shape (..., D) read as N tokens × D channels:

- ``massive_ratio``: max over tokens of ``max_d |x[t, d]| / median_d |x[t, d]|`` — Sun et al. 2024
  ("Massive activations"): entries ~1000× the median magnitude of their hidden state (LLaMA2-7B:
  ~2000 against a median ~0.2). The median of an even D is the lower middle value (``torch.median``).
- ``massive_dim``: the channel d of the largest |x| of the whole tensor (massive activations sit in
  fixed dimensions).
- ``kurtosis``: the excess kurtosis of the D per-channel RMS values ``c_d = √(mean_t x[t, d]²)``:
  ``mean((c − c̄)⁴) / var(c)² − 3`` (population moments; 0 when every channel has the same RMS) —
  outlier features (He et al., NeurIPS 2024): a few channels far above the rest give large values.

Cost: per token the abs-max and the sum of |x| (from one |x| temporary), per channel the sum of
squares — reductions over the last dimension written as ``amax``/``sum`` of an ``abs()``, which run
~10× faster on a CPU than ``aminmax(dim=-1)`` or ``vector_norm(dim=...)`` there; a median is a
partial sort, so it is taken only on the `CANDIDATES` tokens with the largest ``max |x| / mean |x|``
(a massive token has both a huge max and a mean it dominates), which is exact whenever
N ≤ `CANDIDATES` and in practice finds the massive token. Temporaries: (N,) vectors, and blocks of
tokens of at most `CHUNK_ELEMENTS` entries (their |x|, float32 or wider), so they stay flat in the
sequence length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CANDIDATES = 64
"""Tokens whose median |x| is computed (those most likely to hold the largest max/median ratio)."""

TINY = 1e-30
"""Floor of a median or variance in a division (an all-zero token: ratio 0)."""


CHUNK_ELEMENTS = (1 << 20) // 4
"""Largest block of tokens (in entries) whose |x| is made at once (1 MiB in float32)."""


@dataclass(frozen=True)
class OutlierReductions:
    """What must be read from a hidden state (`reduce_outliers`); `finish_outliers` makes the
    statistics of it later (a probe defers that arithmetic to the end of the step's reads)."""

    row_top: torch.Tensor
    """(K,) float32 max |x| of the candidate tokens."""
    median: torch.Tensor
    """(K,) float32 their median |x|."""
    where: torch.Tensor
    """0-d int64 channel of the largest |x|."""
    sumsq: torch.Tensor
    """(D,) per-channel sum of squares (float32, float64 for a float64 input)."""
    tokens: int
    """N."""


def outlier_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(massive_ratio, massive_dim, kurtosis) of hidden state `x` (..., D): see the module docstring."""
    kept = reduce_outliers(x)
    if kept is None:
        zero = torch.zeros((), device=x.device)
        return zero, zero, zero
    return finish_outliers(kept)


def reduce_outliers(x: torch.Tensor) -> OutlierReductions | None:
    """The passes over `x` (..., D) that `outlier_stats` needs (None for an empty `x`)."""
    x = x.detach()
    flat = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)  # (N, D)
    if not flat.is_floating_point():
        flat = flat.float()
    n, d = flat.shape
    if n == 0 or d == 0:
        return None
    top, mean, sumsq = _token_and_channel_sums(flat)  # (N,), (N,), (D,)
    if n > CANDIDATES:
        idx = (top / mean.clamp_min(TINY)).topk(CANDIDATES).indices  # (K,)
        rows, row_top = flat.index_select(0, idx), top.index_select(0, idx)  # (K, D), (K,)
    else:
        rows, row_top = flat, top
    median = rows.abs().float().median(dim=-1).values  # (K,) lower median
    where = flat.index_select(0, top.argmax().reshape(1)).abs().argmax()  # channel of the largest |x|
    return OutlierReductions(row_top, median, where, sumsq, n)


def finish_outliers(kept: OutlierReductions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(massive_ratio, massive_dim, kurtosis) from `reduce_outliers`' reductions (small ops only)."""
    return _finish(kept.row_top, kept.median, kept.where, kept.sumsq, kept.tokens)


def finish_outliers_stacked(kept: list[OutlierReductions]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`finish_outliers` of several hidden states of one shape and device at once (the blocks of a
    step): three (n,) vectors, in the order of `kept`."""
    first = kept[0]

    def stack(field: str) -> torch.Tensor:
        return torch.stack([getattr(k, field) for k in kept])

    return _finish(stack("row_top"), stack("median"), stack("where"), stack("sumsq"), first.tokens)


def stack_key(kept: OutlierReductions) -> tuple[object, ...]:
    """Reductions with the same key finish together (`finish_outliers_stacked`)."""
    return kept.row_top.shape, kept.sumsq.shape, kept.sumsq.dtype, kept.sumsq.device, kept.tokens


def _finish(
    row_top: torch.Tensor, median: torch.Tensor, where: torch.Tensor, sumsq: torch.Tensor, tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The statistics of (..., K) candidate maxima and medians, (...) channels of the largest |x| and
    (..., D) channel sums of squares over `tokens` tokens, per leading index."""
    ratio = (row_top / median.clamp_min(TINY)).amax(dim=-1)
    # the moments of the D channel RMS values in float64 where the device has it: an excess kurtosis
    # near 0 is a difference of two numbers near 3, which float32 rounding would leave ~1e-6 off
    wide = torch.float64 if sumsq.device.type != "mps" else torch.float32
    channel = (sumsq.to(wide) / tokens).sqrt()  # (..., D) per-channel RMS
    centred = channel - channel.mean(dim=-1, keepdim=True)
    var = centred.pow(2).mean(dim=-1)
    fourth = centred.pow(4).mean(dim=-1)
    kurtosis = torch.where(var > 0, fourth / var.clamp_min(TINY).pow(2) - 3.0, 0.0).float()
    return ratio, where.float(), kurtosis


def _token_and_channel_sums(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Of (N, D) `flat`: per token the max |x| and the mean |x| (float32, (N,)), per channel the sum of
    squares ((D,), float32 — float64 for a float64 input, whose precision it keeps), over blocks of
    tokens of at most `CHUNK_ELEMENTS` entries (traced by Dynamo: in one block, which Inductor reads
    without making |x|, and no loop over a length that may vary)."""
    n, d = flat.shape
    wide = flat.dtype.itemsize > 4
    acc = flat.dtype if wide else torch.float32
    if torch.compiler.is_compiling():  # traced into the graph: Inductor fuses the reductions, no |x| made
        mag = flat.abs() if flat.dtype == acc else flat.to(acc).abs()
        return mag.amax(dim=-1).float(), mag.sum(dim=-1).float() / d, (mag * mag).sum(dim=0)
    rows = max(1, CHUNK_ELEMENTS // d)
    tops: list[torch.Tensor] = []
    sums: list[torch.Tensor] = []
    sumsq = torch.zeros(d, dtype=acc, device=flat.device)
    for start in range(0, n, rows):
        part = flat[start : start + rows]  # (r, D) view
        mag = part.abs() if part.dtype == acc else part.to(acc).abs_()  # (r, D): the one temporary
        tops.append(mag.amax(dim=-1).float())
        sums.append(mag.sum(dim=-1).float())
        sumsq += mag.mul_(mag).sum(dim=0)
        del mag
    top = tops[0] if len(tops) == 1 else torch.cat(tops)
    total = sums[0] if len(sums) == 1 else torch.cat(sums)
    return top, total / d, sumsq
