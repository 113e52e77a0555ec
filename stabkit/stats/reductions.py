"""Fused on-device reductions used by probes. Called inside hooks; never sync with the host."""

from __future__ import annotations

import math

import torch


def tensor_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rms, abs-max, non-finite count) of `x`, as float32 0-d device tensors.

    Three passes over `x`. When `x` holds NaN/Inf, rms and abs-max are non-finite too and the
    count says how many entries were not finite.
    """
    x = x.detach()
    if x.numel() == 0:
        zero = torch.zeros((), device=x.device)
        return zero, zero, zero
    xf = x.float()
    rms = torch.linalg.vector_norm(xf) / math.sqrt(xf.numel())
    absmax = xf.abs().amax()
    nonfinite = (xf.numel() - torch.isfinite(xf).sum()).float()
    return rms, absmax, nonfinite


def l2_of_norms(norms: list[torch.Tensor]) -> torch.Tensor:
    """√(Σ nᵢ²): combine per-tensor L2 norms into the norm of their concatenation (never a sum of norms)."""
    if not norms:
        return torch.zeros(())
    return torch.linalg.vector_norm(torch.stack([n.float().reshape(()) for n in norms]))


def logit_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max |logit|, mean log Z, max log Z) over the last (vocabulary) dimension, float32 on device."""
    lf = logits.detach().float()
    logz = torch.logsumexp(lf, dim=-1)  # (B, T)
    return lf.abs().amax(), logz.mean(), logz.amax()
