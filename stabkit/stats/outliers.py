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

Cost: three reductions that read `x` without copying it (per-token abs-max and mean |x|, per-channel
sum of squares); a median is a partial sort, so it is taken only on the `CANDIDATES` tokens with the
largest ``max |x| / mean |x|`` (a massive token has both a huge max and a mean it dominates), which
is exact whenever N ≤ `CANDIDATES` and in practice finds the massive token. Temporaries: (N,) and
(CANDIDATES, D), flat in the sequence length beyond the per-token vectors.
"""

from __future__ import annotations

import torch

CANDIDATES = 64
"""Tokens whose median |x| is computed (those most likely to hold the largest max/median ratio)."""

TINY = 1e-30
"""Floor of a median or variance in a division (an all-zero token: ratio 0)."""


def outlier_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(massive_ratio, massive_dim, kurtosis) of hidden state `x` (..., D): see the module docstring."""
    x = x.detach()
    flat = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)  # (N, D)
    if not flat.is_floating_point():
        flat = flat.float()
    n, d = flat.shape
    if n == 0 or d == 0:
        zero = torch.zeros((), device=flat.device)
        return zero, zero, zero
    lo, hi = torch.aminmax(flat, dim=-1)  # (N,), (N,)
    top = torch.maximum(hi, -lo).float()  # (N,) max |x| per token
    mean = _norm(flat, 1, -1) / d  # (N,) mean |x| per token
    if n > CANDIDATES:
        idx = (top / mean.clamp_min(TINY)).topk(CANDIDATES).indices  # (K,)
        rows, row_top = flat.index_select(0, idx), top.index_select(0, idx)  # (K, D), (K,)
    else:
        rows, row_top = flat, top
    median = rows.abs().float().median(dim=-1).values  # (K,) lower median
    ratio = (row_top / median.clamp_min(TINY)).amax()
    where = flat.index_select(0, top.argmax().reshape(1)).abs().argmax()  # channel of the largest |x|
    channel = _norm(flat, 2, 0) / n**0.5  # (D,) per-channel RMS
    centred = channel - channel.mean()
    var = centred.pow(2).mean()
    fourth = centred.pow(4).mean()
    kurtosis = torch.where(var > 0, fourth / var.clamp_min(TINY).pow(2) - 3.0, 0.0)
    return ratio, where.float(), kurtosis


def _norm(x: torch.Tensor, order: int, dim: int) -> torch.Tensor:
    """float32 vector norm over `dim`, accumulated in float32 from narrower dtypes and in the input's
    own precision from wider ones (torch refuses to narrow inside the norm)."""
    if x.dtype.itemsize > 4:
        return torch.linalg.vector_norm(x, ord=order, dim=dim).float()
    return torch.linalg.vector_norm(x, ord=order, dim=dim, dtype=torch.float32)
