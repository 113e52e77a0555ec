"""Fused on-device reductions used by probes. Called inside hooks; never sync with the host."""

from __future__ import annotations

import math

import torch

LOGZ_CHUNKS = 64
"""The log Z reduction runs over at most this many row chunks: its temporaries stay ~1/32 of the
logits' size (the logits themselves are resident anyway), with few kernel launches."""


def tensor_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rms, abs-max, non-finite count) of `x`, as float32 0-d device tensors.

    The norm and min/max accumulate from the input dtype without a float copy. The count uses
    `x * 0`, which is 0 for finite entries and NaN for NaN/±Inf, so `nan_to_num_(nan=1).sum()`
    counts them (~7x cheaper on a CPU than `isfinite(x).sum()`, which makes several boolean
    passes). rms and abs-max are non-finite whenever `x` holds a NaN/Inf, so on a CPU — where
    reading a value involves no device synchronisation — the count is only computed when they
    are; on an accelerator it is always computed, on the device, without a sync.
    """
    x = x.detach()
    if x.numel() == 0:
        zero = torch.zeros((), device=x.device)
        return zero, zero, zero
    if not x.is_floating_point():
        x = x.float()
    rms = torch.linalg.vector_norm(x, dtype=torch.float32) / math.sqrt(x.numel())
    lo, hi = torch.aminmax(x)
    absmax = torch.maximum(hi, -lo).float()
    # sync point: reads host memory only (CPU tensors), never a device
    if x.device.type == "cpu" and math.isfinite(float(rms)) and math.isfinite(float(absmax)):
        return rms, absmax, torch.zeros(())
    marks = x * 0  # 0 where finite, NaN where NaN or ±Inf
    marks.nan_to_num_(nan=1.0)
    nonfinite = marks.sum(dtype=torch.float32)
    return rms, absmax, nonfinite


def l2_of_norms(norms: list[torch.Tensor]) -> torch.Tensor:
    """√(Σ nᵢ²): combine per-tensor L2 norms into the norm of their concatenation (never a sum of norms)."""
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([n.float().reshape(()) for n in norms]))


def logit_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max |logit|, mean log Z, max log Z) over the last (vocabulary) dimension, float32 on device.

    log Z = logsumexp is computed over LOGZ_CHUNKS row chunks, so its temporaries stay a small
    fraction of the logits (the probe runs at the end of the forward pass, where memory peaks).
    """
    flat = logits.detach().reshape(-1, logits.shape[-1])  # (N, V)
    lo, hi = torch.aminmax(flat)
    max_abs = torch.maximum(hi, -lo).float()
    rows = max(1, -(-flat.shape[0] // LOGZ_CHUNKS))  # ceil
    total = torch.zeros((), device=flat.device)
    peak = torch.full((), -math.inf, device=flat.device)
    for start in range(0, flat.shape[0], rows):
        logz = torch.logsumexp(flat[start : start + rows].float(), dim=-1)  # (rows,)
        total = total + logz.sum()
        peak = torch.maximum(peak, logz.amax())
    return max_abs, total / max(1, flat.shape[0]), peak
