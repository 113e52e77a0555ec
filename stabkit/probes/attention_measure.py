"""Measure one attention call on a sample: entropy on a uniform sample, max |logit| on that sample
plus the queries most likely to hold it.

Runs inside the attention probe's handler on sampled steps, under ``no_grad``, float32, no host sync.

With sampling on (`MonitorConfig.attn_sample_rows` / `attn_sample_queries`), a budget of
``rows × queries`` query rows (per head) is spent twice:

- *uniform*: ``rows`` consecutive batch rows × ``queries`` evenly strided positions (rotating with
  the sampled step) — an unbiased sample for the entropy, and part of the max;
- *max candidates* (q/k calls): in every batch row, the ``⌈rows·queries / B⌉`` queries with the
  largest bound ``‖q‖ · max ‖k‖`` over the keys they may see (causal: prefix max) — the max |logit|
  is a max over a few (query, key) pairs, usually at large-norm queries, which a uniform row sample
  misses (on the tiny reference GPT trained on text, 4 of 16 rows give 55–80 % of the exact max;
  the candidates find it). On the eager softmax path the logits are already materialised, so the max
  is taken over the whole tensor (in chunks of batch rows, bounded memory).

Every value is a max over a subset of the allowed entries, so it never exceeds the exact max.
"""

from __future__ import annotations

import math

import torch

from ..attention.math import attention_logits
from .attention_calls import LogitsCall, QKCall, additive_allowed
from .attention_stats import EXACT, HeadStats, Sampling, causal_allowed, head_stats, take

CHUNK_ELEMENTS = 1 << 22
"""Largest temporary (elements) of the chunked full max on the softmax path (16 MiB in float32)."""
SAMPLE_CHUNK_ELEMENTS = 1 << 15
"""Logits materialised at once (in batch rows, at least one) when measuring q/k calls: the probe
often runs near the end of the forward pass, where memory peaks, so its temporaries stay small."""


def _row_chunks(n_rows: int, per_row: int) -> list[slice]:
    """Consecutive slices of `n_rows` batch rows with about SAMPLE_CHUNK_ELEMENTS logits each."""
    step = max(1, SAMPLE_CHUNK_ELEMENTS // max(per_row, 1))
    return [slice(i, min(i + step, n_rows)) for i in range(0, n_rows, step)]


def _merge(a: HeadStats | None, b: HeadStats) -> HeadStats:
    """Per-head statistics of two disjoint sets of rows."""
    if a is None:
        return b
    return HeadStats(torch.maximum(a.max_logit, b.max_logit), a.entropy_sum + b.entropy_sum, a.rows + b.rows)


def measure(call: QKCall | LogitsCall, sampling: Sampling = EXACT, cap: float | None = None) -> HeadStats:
    """Per-head statistics of one call on `sampling` (`cap`: soft cap on the logits, for the entropy)."""
    if isinstance(call, LogitsCall):
        return _measure_logits(call.x, sampling, cap)
    return _measure_qk(call, sampling, cap)


def logits_of(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    """(b, H, l, S) float32 logits q·kᵀ·scale; kv heads repeated for GQA/MQA."""
    return attention_logits(q.float(), k.float(), scale, enable_gqa=k.shape[1] != q.shape[1])


def _and(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a & b


def candidates_per_row(sampling: Sampling, batch: int, n_queries: int) -> int:
    """Max candidates per batch row (0 when the uniform sample already covers everything)."""
    rows = batch if sampling.rows is None else min(sampling.rows, batch)
    queries = n_queries if sampling.queries is None else min(sampling.queries, n_queries)
    if rows == batch and queries == n_queries:
        return 0
    return min(n_queries, math.ceil(rows * queries / batch))


def _measure_qk(call: QKCall, sampling: Sampling, cap: float | None) -> HeadStats:
    q, k = call.q, call.k  # (B, H, L, E), (B, Hkv, S, E)
    batch, n_q, n_k = max(q.shape[0], k.shape[0]), q.shape[2], k.shape[2]
    rows, queries = sampling.row_slice(batch), sampling.query_slice(n_q)
    q_s, k_s = take(q, rows, queries), take(k, rows, slice(None))  # (b, H, l, E), (b, Hkv, S, E)
    allowed = None if call.allowed is None else take(call.allowed, rows, queries)
    if call.causal:
        allowed = _and(allowed, causal_allowed(queries, n_q, n_k, q.device))
    bias = None if call.bias is None else take(call.bias, rows, queries).float()
    n_rows = max(q_s.shape[0], k_s.shape[0])
    stats: HeadStats | None = None
    for part in _row_chunks(n_rows, q_s.shape[1] * q_s.shape[2] * n_k):
        q_part, k_part = _rows(q_s, part), _rows(k_s, part)
        assert q_part is not None and k_part is not None
        logits = logits_of(q_part, k_part, call.scale)  # (c, H, l, S)
        part_stats = head_stats(logits, _rows(allowed, part), _rows(bias, part), cap)
        stats = _merge(stats, part_stats)
    assert stats is not None
    per_row = candidates_per_row(sampling, batch, n_q)
    if per_row and q.shape[0] == k.shape[0]:
        stats.max_logit = torch.maximum(stats.max_logit, candidate_max(call, per_row))
    return stats


def _rows(t: torch.Tensor | None, part: slice) -> torch.Tensor | None:
    """Batch rows `part` of `t` (a size-1 batch dim broadcasts and stays whole)."""
    if t is None or t.shape[0] == 1:
        return t
    return t[part]


def candidate_max(call: QKCall, per_row: int) -> torch.Tensor:
    """(H,) max |logit| over the `per_row` queries of each (row, head) with the largest ‖q‖·reach,
    where reach is the largest key norm the query may see (all keys; causal: keys up to it)."""
    q, k = call.q, call.k  # (B, H, L, E), (B, Hkv, S, E)
    batch, heads, n_q, dim = q.shape
    n_k = k.shape[2]
    score = torch.linalg.vector_norm(q, dim=-1, dtype=torch.float32)  # (B, H, L)
    if call.causal:
        k_norm = torch.linalg.vector_norm(k, dim=-1, dtype=torch.float32)  # (B, Hkv, S)
        prefix = k_norm.cummax(dim=-1).values.index_select(
            -1, torch.arange(n_q, device=q.device).clamp(max=n_k - 1)
        )  # (B, Hkv, L): largest key norm query i sees
        score = score * prefix.repeat_interleave(heads // k.shape[1], dim=1)
    idx = score.topk(per_row, dim=-1).indices  # (B, H, m)
    chosen = q.gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, dim))  # (B, H, m, E)
    full = None if call.allowed is None else call.allowed.expand(batch, heads, n_q, n_k)
    out: torch.Tensor | None = None
    for part in _row_chunks(batch, heads * per_row * n_k):
        logits = logits_of(chosen[part], k[part], call.scale)  # (c, H, m, S)
        part_idx = idx[part].unsqueeze(-1)  # (c, H, m, 1)
        allowed: torch.Tensor | None = None
        if full is not None:
            allowed = full[part].gather(2, part_idx.expand(-1, -1, -1, n_k))  # (c, H, m, S)
        if call.causal:
            allowed = _and(allowed, torch.arange(n_k, device=q.device) <= part_idx)
        mag = logits.abs()
        if allowed is not None:
            mag = torch.where(allowed, mag, 0.0)
        m = mag.amax(dim=(0, 2, 3))  # (H,)
        out = m if out is None else torch.maximum(out, m)
    assert out is not None
    return out


def _measure_logits(x: torch.Tensor, sampling: Sampling, cap: float | None) -> HeadStats:
    batch, _, n_q, _ = x.shape  # (B, H, L, S)
    sample = take(x, sampling.row_slice(batch), sampling.query_slice(n_q))  # (b, H, l, S)
    stats = head_stats(sample.float(), additive_allowed(sample), None, cap)
    if candidates_per_row(sampling, batch, n_q):
        stats.max_logit = torch.maximum(stats.max_logit, full_max(x))
    return stats


def full_max(x: torch.Tensor) -> torch.Tensor:
    """(H,) float32 max |x| over the unmasked entries (> finfo.min/2) of (B, H, L, S) `x`, in chunks
    of batch rows so the temporaries stay under `CHUNK_ELEMENTS`."""
    per_row = x[0].numel()
    step = max(1, CHUNK_ELEMENTS // max(per_row, 1))
    threshold = torch.finfo(x.dtype).min / 2
    out: torch.Tensor | None = None
    for chunk in x.split(step, dim=0):
        m = torch.where(chunk <= threshold, 0, chunk.abs()).amax(dim=(0, 2, 3))  # (H,)
        out = m if out is None else torch.maximum(out, m)
    assert out is not None
    return out.float()
