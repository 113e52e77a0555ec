"""Measure one attention call on a sample: entropy on a uniform sample, max |logit| on that sample
plus the queries most likely to hold it — in blocks, so the memory stays within a fixed budget.

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
  is taken over the whole tensor.

Every value is a max over a subset of the allowed entries, so it never exceeds the exact max. The
first-key mass (attention sinks) is measured on the uniform sample, with the entropy.

Memory: every pass runs over blocks of (batch rows, heads, queries, keys) planned by
`stabkit.attention.measure.blocks.plan` so that its temporaries stay within `budget` bytes
(`MonitorConfig.attn_chunk_bytes`); the entropy of a query row is accumulated over its key blocks
(`stabkit.attention.measure.stats.RowSums`). Nothing the size of the sample, let alone of the full logits, is made.
"""

from __future__ import annotations

import math

import torch

from ..call import LogitsCall, QKCall
from . import fast
from .blocks import (
    QKBlocks,
    candidate_reach,
    cost_logits,
    cost_qk,
    cost_scores,
    dims_of,
    pick_queries,
    plan,
    spans,
    top_candidates,
)
from .masks import IndexMask
from .stats import EXACT, HeadStats, RowSums, Sampling, fill_, masked_absmax, softmax_input

CHUNK_ELEMENTS = (4 << 20) // 4
"""Default budget of `measure`, in float32 elements (the default `MonitorConfig.attn_chunk_bytes`)."""


@torch.no_grad()
def measure(
    call: QKCall | LogitsCall,
    sampling: Sampling = EXACT,
    cap: float | None = None,
    budget: int | None = None,
) -> HeadStats:
    """Per-head statistics of one call on `sampling` (`cap`: soft cap on the logits, for the
    entropy), with temporaries within `budget` bytes (None: ``4 · CHUNK_ELEMENTS``)."""
    budget = 4 * CHUNK_ELEMENTS if budget is None else budget
    if not _sample_is_smaller(call, sampling):  # a small call: measuring all of it reads less
        sampling = EXACT
    if isinstance(call, LogitsCall):
        return _measure_logits(call.x, sampling, cap, budget, call.sink_columns)
    if fast.applies(call, sampling):  # the common call, in one block: the same numbers, fewer ops
        batch, n_q = call.q.shape[0], call.q.shape[2]
        per_row = candidates_per_row(sampling, batch, n_q)
        rows = len(range(batch)[sampling.row_slice(batch)])
        queries = len(range(n_q)[sampling.query_slice(n_q)])
        if fast.fits(call, rows, queries, per_row, budget):
            return fast.measure_one_block(call, sampling, cap, per_row)
    return _measure_qk(call, sampling, call.softcap or cap, budget)


def _sample_is_smaller(call: QKCall | LogitsCall, sampling: Sampling) -> bool:
    """Whether `sampling` reads fewer query rows of `call` than the whole call: the uniform sample
    (rows × queries) plus the max candidates (`candidates_per_row` in every batch row). On a small
    call they add up to all of it or more — 8 rows × 64 queries with the default 4 × 64 sample: 256
    sampled + 8 × 32 candidates — and measuring every row exactly is cheaper (0.67 against 0.96 ms a
    call on one CPU thread, 4 heads of 32) and exact. Decided from shapes only (no sync; under
    torch.compile a guard on them at most)."""
    if isinstance(call, LogitsCall):
        batch, n_q = call.x.shape[0], call.x.shape[2]
    else:
        batch, n_q = max(call.q.shape[0], call.k.shape[0]), call.q.shape[2]
    per_row = candidates_per_row(sampling, batch, n_q)
    if not per_row:
        return False  # the sample is the whole call already
    rows = batch if sampling.rows is None else min(sampling.rows, batch)
    queries = n_q if sampling.queries is None else min(sampling.queries, n_q)
    return rows * queries + batch * per_row < batch * n_q


def candidates_per_row(sampling: Sampling, batch: int, n_queries: int) -> int:
    """Max candidates per batch row (0 when the uniform sample already covers everything)."""
    rows = batch if sampling.rows is None else min(sampling.rows, batch)
    queries = n_queries if sampling.queries is None else min(sampling.queries, n_queries)
    if rows == batch and queries == n_queries:
        return 0
    return min(n_queries, math.ceil(rows * queries / batch))


def _measure_qk(call: QKCall, sampling: Sampling, cap: float | None, budget: int) -> HeadStats:
    q, k = call.q, call.k  # (B, H, L, E), (B, Hkv, S, E)
    batch, n_q = max(q.shape[0], k.shape[0]), q.shape[2]
    sample = sampling.sample(batch, n_q, q.device)
    index_mask = IndexMask.of(call)
    blocks = QKBlocks(
        q=sample.take(q),  # (b, H, l, E) view (compiled: a gathered copy)
        k=sample.take(k, queries=False),  # (b, Hkv, S, E) view
        scale=call.scale,
        allowed=None if call.allowed is None else sample.take(call.allowed),
        bias=None if call.bias is None else sample.take(call.bias),
        q_index=sample.query_index(n_q, q.device).view(1, 1, -1),  # (1, 1, l)
        causal=call.causal,
        host_positions=sample.positions if call.causal else None,
        row_index=sample.row_index(batch, q.device) if index_mask is not None else None,
        index_mask=index_mask,
        q_invalid=sample.invalid,
    )
    sinks = None if call.sinks is None else call.sinks.detach().float().reshape(-1)
    stats = _sweep(blocks, cap, budget, sinks=sinks)
    per_row = candidates_per_row(sampling, batch, n_q)
    if per_row and q.shape[0] == k.shape[0]:
        stats.max_logit = torch.maximum(stats.max_logit, candidate_max(call, per_row, budget))
    return stats


def _sweep(
    blocks: QKBlocks, cap: float | None, budget: int, entropy: bool = True, sinks: torch.Tensor | None = None
) -> HeadStats:
    """Per-head statistics of a QKBlocks over all its keys: max |logit|, and (`entropy`) the row
    entropies accumulated over key blocks (with `sinks` (H,): one more softmax column per head, whose
    probability is summed into `HeadStats.sink_sum`)."""
    heads = blocks.q.shape[1]
    out = HeadStats.zeros(heads, blocks.q.device)
    if sinks is not None:
        out.sink_sum = torch.zeros(heads, device=blocks.q.device)
    dims = (blocks.rows, blocks.k.shape[1], blocks.q.shape[2], blocks.k.shape[2])
    group, dim = blocks.group, blocks.q.shape[-1]
    extra = blocks.index_mask.bytes_per_logit if blocks.index_mask is not None else 0
    sizes = plan(dims, lambda *s: cost_qk(*s, group=group, dim=dim, state=entropy, extra=extra), budget)
    row_spans, kv_spans, q_spans, k_spans = (spans(n, c) for n, c in zip(dims, sizes, strict=True))
    causal_host = blocks.host_positions is not None
    for rs in row_spans:
        for kv in kv_spans:
            hs = slice(kv.start * group, kv.stop * group)
            tops = [out.max_logit[hs]]  # (h,) per block
            for qs in q_spans:
                sums = RowSums() if entropy else None  # the rows' softmax sums over the key blocks
                first = None  # (b, h, l) softmax input at key 0
                for ks in k_spans:
                    if causal_host and ks.start > blocks.last_query(qs):
                        continue  # causal: every key of the block comes after every query of it
                    logits = blocks.logits(rs, kv, qs, ks)  # (b, h, l, s) float32, own storage
                    blocked = blocks.blocked(rs, hs, qs, ks)
                    tops.append(masked_absmax(logits, blocked))
                    if sums is not None:
                        bias, modify = blocks.bias_block(rs, hs, qs, ks), blocks.modifier(rs, hs, qs, ks)
                        z = softmax_input(logits, blocked, bias, cap, modify)
                        if ks.start == 0:
                            first = z[..., 0].clone()
                        sums.add(z)
                    del logits, blocked
                if sums is not None:
                    if sinks is not None and out.sink_sum is not None:
                        sink = sinks[hs].view(1, -1, 1).expand(*sums.shape)  # (b, h, l)
                        sums.add(sink.unsqueeze(-1).clone())
                        out.sink_sum[hs] += sums.share(sink).sum(dim=(0, 2))
                    if first is not None and out.first_sum is not None:
                        out.first_sum[hs] += sums.share(first).sum(dim=(0, 2))
                    row_entropy, valid = sums.entropy()  # (b, h, l)
                    out.entropy_sum[hs] += row_entropy.sum(dim=(0, 2))
                    out.rows[hs] += valid.sum(dim=(0, 2))
            out.max_logit[hs] = torch.stack(tops).amax(dim=0)
    return out


def candidate_max(call: QKCall, per_row: int, budget: int) -> torch.Tensor:
    """(H,) max |logit| over the `per_row` queries of each (row, head) with the largest ‖q‖·reach,
    where reach is the largest key norm the query may see (all keys; causal: keys up to it).
    Scored in blocks of (rows, kv heads) within `budget`."""
    q, k = call.q, call.k  # (B, H, L, E), (B, Hkv, S, E)
    batch, heads, n_q, dim = q.shape
    kv_heads, n_k = k.shape[1], k.shape[2]
    group = heads // kv_heads
    out = torch.zeros(heads, device=q.device)
    sizes = plan(
        (batch, kv_heads, 1, 1),
        lambda b, kv, _l, _s: cost_scores(b, kv, group=group, n_q=n_q, n_k=n_k, per_row=per_row, dim=dim),
        budget,
    )
    reach = candidate_reach(call, n_q, n_k)  # (L,) last key each query may see, or None (any key)
    index_mask = IndexMask.of(call)
    for rs in spans(batch, sizes[0]):
        for kv in spans(kv_heads, sizes[1]):
            hs = slice(kv.start * group, kv.stop * group)
            q_part, k_part = q[rs, hs], k[rs, kv]  # (b, h, L, E), (b, hkv, S, E) views
            idx = top_candidates(q_part, k_part, reach, per_row)  # (b, h, m)
            chosen = pick_queries(q_part, idx)  # (b, h, m, E)
            allowed = None
            if call.allowed is not None:
                allowed = call.allowed[rs if call.allowed.shape[0] > 1 else slice(None)]
                allowed = allowed[:, hs if allowed.shape[1] > 1 else slice(None)]
            blocks = QKBlocks(
                chosen,
                k_part,
                call.scale,
                allowed,
                None,
                q_index=idx,
                causal=call.causal,
                gather=True,
                row_index=torch.arange(batch, device=q.device)[rs] if index_mask is not None else None,
                index_mask=index_mask,
                head_offset=hs.start,
            )
            top = _sweep(blocks, None, budget, entropy=False).max_logit
            out[hs] = torch.maximum(out[hs], top)
    return out


def _measure_logits(
    x: torch.Tensor, sampling: Sampling, cap: float | None, budget: int, sink_columns: int = 0
) -> HeadStats:
    """Eager path: statistics of a sample of the materialised (B, H, L, S) softmax input `x`; its last
    `sink_columns` columns are learned sink logits (in the entropy and the sink mass, not the max)."""
    batch, heads, n_q, _ = x.shape
    sinks = x[..., x.shape[-1] - sink_columns :] if sink_columns else None  # (B, H, L, n)
    x = x[..., : x.shape[-1] - sink_columns] if sink_columns else x
    picked = sampling.sample(batch, n_q, x.device)
    sample = picked.take(x)  # (b, H, l, S) view (compiled: a gathered copy)
    sink_sample = picked.take(sinks) if sinks is not None else None
    invalid = None if picked.invalid is None else picked.invalid.view(1, 1, -1, 1)  # (1, 1, l, 1)
    threshold = torch.finfo(x.dtype).min / 2
    out = HeadStats.zeros(heads, x.device)
    if sink_sample is not None:
        out.sink_sum = torch.zeros(heads, device=x.device)
    dims = dims_of(sample)
    sizes = plan(dims, lambda *s: cost_logits(*s, itemsize=x.element_size(), state=True), budget)
    row_spans, h_spans, q_spans, k_spans = (spans(n, c) for n, c in zip(dims, sizes, strict=True))
    for rs in row_spans:
        for hs in h_spans:
            for qs in q_spans:
                sums = RowSums()
                first = None  # (b, h, l) softmax input at key 0
                for ks in k_spans:
                    part = sample[rs, hs, qs, ks]  # (b, h, l, s) view
                    blocked = part <= threshold  # masked by an additive finfo.min/-inf
                    if invalid is not None:  # compiled sample: a slot past the end sees no key
                        blocked = blocked | invalid[:, :, qs]
                    logits = part.to(torch.float32, copy=True)
                    out.max_logit[hs] = torch.maximum(out.max_logit[hs], masked_absmax(logits, blocked))
                    z = softmax_input(logits, blocked, None, cap)
                    if ks.start == 0:
                        first = z[..., 0].clone()
                    sums.add(z)
                    del part, blocked, logits, z
                if sink_sample is not None and out.sink_sum is not None:
                    sink = sink_sample[rs, hs, qs].float()  # (b, h, l, n)
                    if invalid is not None:
                        fill_(sink, invalid[:, :, qs], -torch.inf)
                    sums.add(sink.clone())
                    out.sink_sum[hs] += sums.share(sink).sum(dim=(0, 2))
                if first is not None and out.first_sum is not None:
                    out.first_sum[hs] += sums.share(first).sum(dim=(0, 2))
                row_entropy, valid = sums.entropy()
                out.entropy_sum[hs] += row_entropy.sum(dim=(0, 2))
                out.rows[hs] += valid.sum(dim=(0, 2))
    if candidates_per_row(sampling, batch, n_q):
        out.max_logit = torch.maximum(out.max_logit, full_max(x, budget))
    return out


def full_max(x: torch.Tensor, budget: int | None = None) -> torch.Tensor:
    """(H,) float32 max |x| over the unmasked entries (> finfo.min/2) of (B, H, L, S) `x`, in blocks
    whose temporaries stay within `budget` bytes (None: ``4 · CHUNK_ELEMENTS``)."""
    budget = 4 * CHUNK_ELEMENTS if budget is None else budget
    dims = dims_of(x)
    sizes = plan(dims, lambda *s: cost_logits(*s, itemsize=x.element_size(), state=False), budget)
    threshold = torch.finfo(x.dtype).min / 2
    out = torch.zeros(x.shape[1], device=x.device)
    row_spans, h_spans, q_spans, k_spans = (spans(n, c) for n, c in zip(dims, sizes, strict=True))
    for rs in row_spans:
        for hs in h_spans:
            for qs in q_spans:
                for ks in k_spans:
                    part = x[rs, hs, qs, ks]
                    mag = fill_(part.abs(), part <= threshold, 0.0)
                    out[hs] = torch.maximum(out[hs], mag.amax(dim=(0, 2, 3)).float())
                    del mag
    return out
