"""The attention probe's one-block path: the common call (plain causal or unmasked q/k attention,
no bias, no sinks, no index mask) whose sample and max candidates each fit the memory budget in
one block, measured with the fewest ops.

Runs inside `stabkit.attention.measure.measure.measure` (the attention probe's handler on sampled steps, under
``no_grad``, eager; and inside the compiled probe's opaque op, which calls the same eager code).
It does the arithmetic of the blocked path (`stabkit.attention.measure.measure._sweep` and `candidate_max` on a
single block) in the same order on the same values, so on finite logits its results are bitwise
those of the blocked path — without its per-block bookkeeping (spans, running sums, per-head
accumulators), and with the causal mask of the sample added as a 0 / −inf bias instead of written
with ``where`` (a broadcast ``where`` is ~8× slower on a CPU). One difference: a NaN or ±Inf logit
at a masked (future) key of a sampled query or of a max candidate makes its head's statistics NaN
here, where the blocked path leaves it out — only a call whose q or k is already non-finite has one.
"""

from __future__ import annotations

import math

import torch

from ..call import QKCall
from .blocks import candidate_reach, cost_qk, cost_scores, pick_queries, qk_logits, top_candidates
from .stats import CLAMP, HeadStats, Sampling


def applies(call: QKCall, sampling: Sampling) -> bool:
    """Whether `measure_one_block` can measure `call`: same batch for q and k, a plain top-left causal
    mask or none, nothing else added to the logits, eager slices for the sample."""
    return (
        sampling.counter is None
        and call.q.shape[0] == call.k.shape[0]
        and call.allowed is None
        and call.bias is None
        and call.sinks is None
        and call.score_mod is None
        and call.flex is None
        and call.positions is None
    )


def fits(call: QKCall, rows: int, queries: int, per_row: int, budget: int) -> bool:
    """Whether the sample (`rows` × `queries` per head) and the max candidates (`per_row` queries in
    every row, 0: none) each fit `budget` bytes in one block (the blocked path's cost model)."""
    q, k = call.q, call.k
    batch, heads, n_q, dim = q.shape
    kv, n_k = k.shape[1], k.shape[2]
    group = heads // kv
    if cost_qk(rows, kv, queries, n_k, group=group, dim=dim, state=True) > budget:
        return False
    if not per_row:
        return True
    scores = cost_scores(batch, kv, group=group, n_q=n_q, n_k=n_k, per_row=per_row, dim=dim)
    return scores <= budget and cost_qk(batch, kv, per_row, n_k, group=group, dim=dim, state=False) <= budget


def measure_one_block(call: QKCall, sampling: Sampling, cap: float | None, per_row: int) -> HeadStats:
    """Per-head statistics of `call` on `sampling` (the uniform sample, then `per_row` max candidates
    per batch row when > 0), each in one block; `cap`: the soft cap the entropy sees (the call's own
    first). Call only when `applies` and `fits` say so."""
    q, k = call.q, call.k  # (B, H, L, E), (B, Hkv, S, E)
    batch, heads, n_q, _ = q.shape
    sample = sampling.sample(batch, n_q, q.device)
    positions = torch.arange(n_q, device=q.device)[sample.queries]  # (l,)
    logits = qk_logits(sample.take(q), sample.take(k, queries=False), call.scale)  # (b, H, l, S)
    cap = call.softcap or cap
    bias = None
    if call.causal:  # masked by adding 0 / −inf (l, S): ~8× faster on a CPU than a broadcast where
        bias = torch.zeros(positions.shape[0], k.shape[2], device=q.device)
        bias.masked_fill_(_late(positions, k.shape[2]), -math.inf)
    low = (logits if bias is None else logits.sub(bias)).amin(dim=(0, 2, 3))  # over the allowed keys
    high = None  # uncapped: the entropy's row maxima give it
    if cap is not None:  # the entropy caps the logits in place and adds the bias after: the max first
        high = (logits if bias is None else logits.add(bias)).amax(dim=(0, 2, 3))
    elif bias is not None:
        logits.add_(bias)
    entropy, first, row_top = _entropy(logits, bias, cap)  # (b, H, l) each
    if high is None:  # the max over the allowed keys of each row, then over the rows
        high = row_top.amax(dim=(0, 2))
    max_logit = torch.maximum(high, -low)  # (H,)
    rows = entropy.shape[0] * entropy.shape[2]
    stats = HeadStats(
        max_logit=torch.maximum(torch.zeros_like(max_logit), max_logit),
        entropy_sum=entropy.sum(dim=(0, 2)),
        rows=torch.full((heads,), float(rows), device=q.device),
        first_sum=first.sum(dim=(0, 2)),
    )
    if per_row:
        stats.max_logit = torch.maximum(stats.max_logit, _candidate_max(call, per_row))
    return stats


def _late(q_index: torch.Tensor, n_k: int) -> torch.Tensor:
    """bool (..., S): key j comes after the query (top-left causal: j > i), for (...) query indices."""
    return torch.arange(n_k, device=q_index.device) > q_index.unsqueeze(-1)


def _seen(q_index: torch.Tensor, n_k: int) -> torch.Tensor:
    """float32 (..., S): 1 where the query at (...) index i sees key j (top-left causal: j <= i), else
    0 — as ``clamp(i + 1 − j, 0, 1)`` of small integers, exact in float32 (below 2²⁴ keys). A CPU makes
    it ~6× faster than a boolean comparison, and multiplying by it ~7× faster than a ``where``."""
    keys = torch.arange(n_k, device=q_index.device, dtype=torch.float32)
    return (q_index.to(torch.float32) + 1.0).unsqueeze(-1).sub(keys).clamp_(0.0, 1.0)


def _entropy(
    logits: torch.Tensor, bias: torch.Tensor | None, cap: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """((b, H, l) entropy of each query row, its probability on key 0, its largest softmax input) of
    (b, H, l, S) `logits` plus the causal `bias` (0 / −inf, (l, S); without a cap already added;
    overwritten): `stabkit.attention.measure.stats.RowSums` on one key block. Every row sees key 0 (top-left causal or
    no mask), so every row counts."""
    z = logits
    if cap is not None:
        z.div_(cap).tanh_().mul_(cap)
        if bias is not None:
            z.add_(bias)
    top = z.amax(dim=-1)  # (b, H, l): finite (key 0 is allowed) or NaN
    shifted = z.sub_(top.unsqueeze(-1)).clamp_min_(CLAMP)
    e = torch.exp(shifted)
    total = e.sum(dim=-1)
    first = e[..., 0] / total
    moment = e.mul_(shifted).sum(dim=-1)
    return total.log() - moment / total, first, top


def _candidate_max(call: QKCall, per_row: int) -> torch.Tensor:
    """(H,) max |logit| over the `per_row` queries of each (row, head) with the largest ‖q‖·reach
    (`stabkit.attention.measure.measure.candidate_max` on one block)."""
    q, k = call.q, call.k.float().contiguous()  # the keys' one copy: their norms and the logits read it
    n_q, n_k = q.shape[2], k.shape[2]
    idx = top_candidates(q, k, candidate_reach(call, n_q, n_k), per_row)  # (B, H, m)
    logits = qk_logits(pick_queries(q, idx), k, call.scale)  # (B, H, m, S)
    if call.causal:  # keys after the query count as 0: a 0 / 1 factor, not a boolean mask and `where`
        logits.mul_(_seen(idx, n_k))
    top = torch.maximum(logits.amax(dim=(0, 2, 3)), -logits.amin(dim=(0, 2, 3)))
    return torch.maximum(torch.zeros_like(top), top)
