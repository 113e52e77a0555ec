"""Fused on-device reductions used by probes. Called inside hooks; never sync with the host.

Under ``torch.compile`` these run inside the model's graph: nothing here reads a tensor's value on
the host there (`tensor_stats` drops its CPU shortcut), and `logit_stats` computes log Z in one
reduction, which Inductor fuses with the float cast (the row chunks exist for eager memory only).
"""

from __future__ import annotations

import math

import torch

LOGZ_CHUNKS = 64
"""The log Z reduction runs over at most this many row chunks: its temporaries stay ~1/32 of the
logits' size (the logits themselves are resident anyway), with few kernel launches."""
LOGZ_CHUNK_BYTES = 4 << 20
"""...and chunks are never smaller than this (float32 bytes): small logits take one or a few chunks
instead of 64 launches of tiny kernels (the small reference GPT's 2 MiB of logits: 1 instead of 64)."""


def norm_f32(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """L2 norm of `x` (over `dim`, or all of it) as float32, accumulated without a float copy of `x`.

    Half, bfloat16 and float32 inputs accumulate in float32 (``dtype=``); wider ones (float64), which
    torch refuses to narrow inside the norm, in their own precision, then the result is cast. The
    norm of a whole contiguous float32 CPU tensor, eagerly, is √(x·x) by BLAS (`dot_norm`)."""
    whole = dim is None and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()
    if whole and not torch.compiler.is_compiling():
        return dot_norm(x)
    if x.dtype.itemsize > 4:
        return torch.linalg.vector_norm(x, dim=dim).float()
    return torch.linalg.vector_norm(x, dim=dim, dtype=torch.float32)


def dot_norm(x: torch.Tensor) -> torch.Tensor:
    """√(x·x) of a contiguous float32 tensor, 0-d: BLAS's dot (MKL on x86 wheels). On a CPU, right
    after the kernel that wrote a 1 MiB tensor, ~43 µs against ~53 for ``vector_norm``, and closer to
    a float64 sum (relative error of the norm ~1e-7 against ~1.3e-6 at 2¹⁸ entries, 1–4e-5 against
    1e-4 at 2²²: the BLAS kernel keeps many partial sums). Overflows to Inf as the norm does."""
    flat = x.view(-1)
    return torch.dot(flat, flat).sqrt_()


def row_norms_f32(x: torch.Tensor) -> torch.Tensor:
    """float32 L2 norms of the rows of `x` over its last dim: (..., E) -> (...), whatever its layout.

    Read in memory order: a (B, H, T, E) view of a (B, T, H, E) projection is normed as the
    contiguous (B·T·H, E) matrix it is, then seen as (B, H, T) again (a strided view). A CPU norm
    over the last dim of the 4-d view took 110-530 µs per MiB, of the 2-d matrix 59 µs; the same
    values, bit for bit (each row is reduced alone). A layout no permutation makes contiguous is
    normed as it is."""
    if x.dim() < 2:
        return norm_f32(x, dim=-1)
    lead = sorted(range(x.dim() - 1), key=x.stride, reverse=True)
    y = x.permute(*lead, x.dim() - 1)
    if not y.is_contiguous():
        return norm_f32(x, dim=-1)
    norms = norm_f32(y.view(-1, y.shape[-1]), dim=-1).view(y.shape[:-1])
    return norms.permute(*sorted(range(len(lead)), key=lead.__getitem__))


def foreach_norm_f32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-tensor L2 norms as float32 0-d tensors: one fused ``_foreach_norm`` for the tensors of
    at most 32 bits (accumulated in float32) and one for wider ones (float64: normed in float64,
    then cast; torch refuses ``dtype=float32`` for them). Runs every step (the gradient norms):
    the usual all-narrow list is tried first, without a per-tensor dtype scan in Python."""
    if not tensors:
        return []
    if not torch.compiler.is_compiling():
        try:
            return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
        except RuntimeError:  # a float64 tensor: torch will not narrow inside the norm
            pass
    wide = [t.dtype.itemsize > 4 for t in tensors]
    if not any(wide):  # refused for another reason: say it as torch does
        return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    narrow_idx = [i for i, w in enumerate(wide) if not w]
    wide_idx = [i for i, w in enumerate(wide) if w]
    out: dict[int, torch.Tensor] = {}
    if narrow_idx:
        norms = torch._foreach_norm([tensors[i] for i in narrow_idx], 2, dtype=torch.float32)
        out.update(zip(narrow_idx, norms, strict=True))
    norms = torch._foreach_norm([tensors[i] for i in wide_idx], 2)
    out.update((i, n.float()) for i, n in zip(wide_idx, norms, strict=True))
    return [out[i] for i in range(len(tensors))]


CPU_ZERO = torch.zeros(())
"""The non-finite count of a finite CPU tensor (read-only: recorders combine values out of place)."""


def tensor_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rms, abs-max, non-finite count) of `x`, as float32 0-d device tensors.

    The norm and min/max accumulate from the input dtype without a float copy. The count uses
    `x * 0`, which is 0 for finite entries and NaN for NaN/±Inf, so `nan_to_num_(nan=1).sum()`
    counts them (~7x cheaper on a CPU than `isfinite(x).sum()`, which makes several boolean
    passes). The abs-max is non-finite exactly when `x` holds a NaN/Inf (min and max propagate
    NaN), so on a CPU — where reading a value involves no device synchronisation — the count is
    only computed when it is (else a shared zero is returned); on an accelerator it is always
    computed, on the device, without a sync. Under
    ``torch.compile`` it is always computed too (a host read would break the graph): Inductor reads
    `x` once for all four reductions.
    """
    x = x.detach()
    if x.numel() == 0:
        zero = torch.zeros((), device=x.device)
        return zero, zero, zero
    if not x.is_floating_point():
        x = x.float()
    rms = norm_f32(x) / math.sqrt(x.numel())
    lo, hi = torch.aminmax(x)
    absmax = torch.maximum(hi, -lo).float()
    # sync point: reads host memory only (CPU tensors), never a device
    compiling = torch.compiler.is_compiling()
    if not compiling and x.device.type == "cpu" and math.isfinite(float(absmax)):
        return rms, absmax, CPU_ZERO
    return rms, absmax, nonfinite_count(x)


def nonfinite_count(x: torch.Tensor) -> torch.Tensor:
    """float32 0-d count of NaN/±Inf entries of floating `x`, on its device: ``x * 0`` is 0 where
    finite and NaN elsewhere, ``nan_to_num_(nan=1)`` makes those 1, and they are summed."""
    marks = x * 0  # 0 where finite, NaN where NaN or ±Inf
    marks.nan_to_num_(nan=1.0)
    return marks.sum(dtype=torch.float32)


def l2_of_norms(norms: list[torch.Tensor]) -> torch.Tensor:
    """√(Σ nᵢ²): combine per-tensor L2 norms into the norm of their concatenation (never a sum of norms)."""
    if not norms:
        return torch.zeros(())
    parts = [n if n.dim() == 0 and n.dtype == torch.float32 else n.float().reshape(()) for n in norms]
    return torch.linalg.vector_norm(torch.stack(parts))


def logz_chunk_rows(n_rows: int, vocab: int) -> int:
    """Rows per chunk of the log Z reduction over (n_rows, vocab) logits: at most `LOGZ_CHUNKS`
    chunks, each of at least `LOGZ_CHUNK_BYTES` in float32 (or all rows)."""
    return max(1, -(-n_rows // LOGZ_CHUNKS), LOGZ_CHUNK_BYTES // (4 * max(1, vocab)))


def logit_stats(
    logits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max |logit|, mean log Z, max log Z, mean logit) over the last (vocabulary) dimension,
    float32 on device. The mean logit is over the vocabulary and every position: the quantity
    Wortsman et al. 2023 (§3.2, Fig. 4) plot for the output-logit divergence.

    log Z = logsumexp is computed over at most LOGZ_CHUNKS row chunks of at least LOGZ_CHUNK_BYTES
    (`logz_chunk_rows`), so its temporaries stay within the larger of a small fraction of the logits
    and that many bytes (the probe runs at the end of the forward pass, where memory peaks); the
    mean logit is summed from the same float32 chunks.
    """
    flat = logits.detach().reshape(-1, logits.shape[-1])  # (N, V)
    lo, hi = torch.aminmax(flat)
    max_abs = torch.maximum(hi, -lo).float()
    count = max(1, flat.shape[0])
    if torch.compiler.is_compiling():  # one fused reduction; the same per-row log Z as the chunks
        wide = flat.float()  # (N, V), not materialised by Inductor
        logz = torch.logsumexp(wide, dim=-1)  # (N,)
        return max_abs, logz.sum() / count, logz.amax(), wide.sum() / max(1, flat.numel())
    rows = logz_chunk_rows(*flat.shape)
    total = torch.zeros((), device=flat.device)
    logit_sum = torch.zeros((), device=flat.device)
    peak = torch.full((), -math.inf, device=flat.device)
    for start in range(0, flat.shape[0], rows):
        chunk = flat[start : start + rows].float()  # (rows, V)
        logz = torch.logsumexp(chunk, dim=-1)  # (rows,)
        total = total + logz.sum()
        logit_sum = logit_sum + chunk.sum()
        peak = torch.maximum(peak, logz.amax())
    return max_abs, total / count, peak, logit_sum / max(1, flat.numel())
