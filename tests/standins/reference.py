"""Independent float64 reference of stabkit's attention statistics (tests only; does not import stabkit).

Everything is materialised: the set of allowed (batch, head, query, key) entries is built by explicit
loops over documents and positions, straight from the definitions below, and the softmax is a float64
log-sum-exp per row. Sizes in tests are tiny, so clarity wins over speed.

Inputs: q (B, H, L, E), k (B, Hkv, S, E) (and v (B, Hkv, S, Ev) for ``reference_attention``);
query head h reads kv head h // (H // Hkv). Varlen: B = 1, L and S are the packed totals and
``cu_seqlens_q`` / ``cu_seqlens_k`` ((docs + 1,) cumulative lengths) split them into documents; document d
has queries [cq[d], cq[d+1]) and keys [ck[d], ck[d+1]) and attends only within itself.

Definitions, per document with local query index i, local key index j, Lq queries and Sk keys:

- alignment ``causal_align``: offset o = Sk - Lq for "bottom_right" (flash-attn, xformers' FromBottomRight
  biases, TE's *_bottom_right), o = 0 for "top_left" (torch SDPA is_causal, xformers LowerTriangularMask,
  TE causal). d = i + o is the query's diagonal position in key coordinates; the same d is used by
  causal, window, chunk and alibi.
- causal: j <= d.  window (left, right): d - left <= j <= d + right, -1 = that side unbounded.
- chunk c > 0 (flash-attn 3 ``attention_chunk``): floor(j / c) == floor(d / c) (same chunk as d).
- ``attn_mask``: bool, True = may attend (ANDed in); or additive float (added to the scores) where
  -inf or anything <= finfo(mask dtype).min / 2 (Hugging Face's "min value" masking) counts as blocked.
  Broadcastable to (B, H, L, S), in packed coordinates for varlen.
- ``block_mask`` (FlexAttention ``BlockMask``): entry (b, h, i, j) with query block qb = i // Q_BLOCK and
  key block kb = j // KV_BLOCK is allowed iff kb is among the first ``full_kv_num_blocks[b, h, qb]`` of
  ``full_kv_indices[b, h, qb]`` (a full block: allowed whole), or among the first ``kv_num_blocks[b, h, qb]``
  of ``kv_indices[b, h, qb]`` and ``mask_mod(b, h, i, j)`` is True (a partial block). Size-1 batch/head
  dims of the block mask broadcast. This is what the compiled FlexAttention kernel lets through; note
  that eager (uncompiled, CPU) ``flex_attention`` ignores the block lists and applies ``mask_mod`` to
  every entry — the two agree whenever the BlockMask was built from its mask_mod by create_block_mask.

An entry is *allowed* when every given rule allows it. For allowed entries:

- raw logit x = (q·k)·scale, scale defaulting to 1/sqrt(E);
- score = softcap·tanh(x / softcap) if softcap > 0 else x; then + alibi bias (-slope·|d - j|,
  ``alibi_slopes`` (H,), or (B, H) — (documents, H) for varlen, as flash-attn's batch is the document); then + the additive ``attn_mask``; then
  score = score_mod(score, b, h, q_idx, kv_idx) with FlexAttention's signature, called once per entry
  with 0-dim int64 tensors (q_idx / kv_idx are positions in the (packed) tensor);
- p = softmax over the row's allowed entries, plus one extra "sink" column with logit ``sinks[h]`` when
  ``sinks`` (H,) is given (GPT-OSS / TE learnable softmax: it joins the denominator, has no value).

Statistics per head (shape (H,)):

- ``max_logit``: max over all allowed (b, i, j) of |x| (the raw scaled dot product: before softcap,
  alibi, masks, score_mod); 0.0 for a head with no allowed entry.
- ``entropy``: mean over rows (b, i) with at least one allowed key of -Σ p log p (sink column included);
  0.0 when there is no such row.
- ``sink_mass``: mean over those rows of the sink column's probability (zeros without ``sinks``).
- ``rows``: number of rows with at least one allowed key (int64).

``reference_stats`` also returns ``allowed`` (bool, (B, H, L, S)), ``scores`` (final scores, -inf where not
allowed), ``probs`` ((B, H, L, S), zero rows where nothing is allowed) and ``sink_probs`` ((B, H, L)).
``reference_attention`` returns probs @ v, differentiable in q, k, v (and sinks), for output/grad checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

ALIGNMENTS = ("top_left", "bottom_right")


def _documents(b_size, l_size, s_size, cu_seqlens_q, cu_seqlens_k):
    """[(batch, q0, q1, k0, k1)]: one per batch row, or one per packed document (B must be 1)."""
    if cu_seqlens_q is None and cu_seqlens_k is None:
        return [(b, 0, l_size, 0, s_size) for b in range(b_size)]
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError("give both cu_seqlens_q and cu_seqlens_k, or neither")
    if b_size != 1:
        raise ValueError("varlen inputs must have batch size 1 (packed documents)")
    cq = [int(x) for x in cu_seqlens_q.tolist()]
    ck = [int(x) for x in cu_seqlens_k.tolist()]
    if len(cq) != len(ck) or cq[-1] > l_size or ck[-1] > s_size:
        raise ValueError("cu_seqlens do not match each other or the tensors")
    return [(0, cq[d], cq[d + 1], ck[d], ck[d + 1]) for d in range(len(cq) - 1)]


def _rule_allows(i, j, lq, sk, *, causal, causal_align, window, chunk) -> bool:
    d = i + (sk - lq if causal_align == "bottom_right" else 0)
    if causal and j > d:
        return False
    if window[0] >= 0 and j < d - window[0]:
        return False
    if window[1] >= 0 and j > d + window[1]:
        return False
    return not (chunk > 0 and j // chunk != d // chunk)


def _block_mask_allows(block_mask, b, h, i, j) -> bool:
    q_block, kv_block = block_mask.BLOCK_SIZE
    bb = b if block_mask.kv_num_blocks.shape[0] > 1 else 0
    hh = h if block_mask.kv_num_blocks.shape[1] > 1 else 0
    qb, kb = i // q_block, j // kv_block
    if block_mask.full_kv_num_blocks is not None:
        n = int(block_mask.full_kv_num_blocks[bb, hh, qb])
        if kb in [int(x) for x in block_mask.full_kv_indices[bb, hh, qb, :n]]:
            return True
    n = int(block_mask.kv_num_blocks[bb, hh, qb])
    if kb not in [int(x) for x in block_mask.kv_indices[bb, hh, qb, :n]]:
        return False
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return bool(block_mask.mask_mod(t(b), t(h), t(i), t(j)))


def reference_masks(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = False,
    causal_align: str = "top_left",
    window: tuple[int, int] = (-1, -1),
    chunk: int = 0,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    block_mask=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(allowed bool (B, H, L, S), additive float64 bias (B, H, L, S): alibi + float attn_mask)."""
    if causal_align not in ALIGNMENTS:
        raise ValueError(f"causal_align must be one of {ALIGNMENTS}")
    b_size, h_size, l_size, _ = q.shape
    s_size = k.shape[2]
    shape = (b_size, h_size, l_size, s_size)
    allowed = torch.zeros(shape, dtype=torch.bool)
    bias = torch.zeros(shape, dtype=torch.float64)
    for doc, (b, q0, q1, k0, k1) in enumerate(_documents(b_size, l_size, s_size, cu_seqlens_q, cu_seqlens_k)):
        lq, sk = q1 - q0, k1 - k0
        slopes = None
        if alibi_slopes is not None:
            slopes = (
                alibi_slopes
                if alibi_slopes.dim() == 1
                else alibi_slopes[doc if cu_seqlens_q is not None else b]
            )
        offset = sk - lq if causal_align == "bottom_right" else 0
        for i in range(lq):
            for j in range(sk):
                ok = _rule_allows(
                    i, j, lq, sk, causal=causal, causal_align=causal_align, window=window, chunk=chunk
                )
                allowed[b, :, q0 + i, k0 + j] = ok
                if slopes is not None:
                    for h in range(h_size):
                        bias[b, h, q0 + i, k0 + j] = -float(slopes[h]) * abs(i + offset - j)
    if attn_mask is not None:
        m = attn_mask.to("cpu").expand(shape)
        if m.dtype == torch.bool:
            allowed &= m
        else:
            blocked = torch.isneginf(m) | (m <= torch.finfo(m.dtype).min / 2)
            allowed &= ~blocked
            bias = bias + torch.where(blocked, torch.zeros_like(bias), m.to(torch.float64))
    if block_mask is not None:
        if tuple(block_mask.seq_lengths) != (l_size, s_size):
            raise ValueError(f"block_mask.seq_lengths {block_mask.seq_lengths} != {(l_size, s_size)}")
        for b in range(b_size):
            for h in range(h_size):
                for i in range(l_size):
                    for j in range(s_size):
                        if allowed[b, h, i, j] and not _block_mask_allows(block_mask, b, h, i, j):
                            allowed[b, h, i, j] = False
    return allowed, bias


def _raw_logits(q, k, scale):
    h_size, hkv = q.shape[1], k.shape[1]
    if h_size % hkv:
        raise ValueError("query heads must be a multiple of kv heads")
    k64 = k.to(torch.float64).repeat_interleave(h_size // hkv, dim=1)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return (q.to(torch.float64) @ k64.transpose(-2, -1)) * scale


def _final_scores(x, allowed, bias, softcap, score_mod):
    s = softcap * torch.tanh(x / softcap) if softcap > 0 else x
    s = s + bias
    if score_mod is not None:
        s = s.clone()
        t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        for b, h, i, j in allowed.nonzero().tolist():
            s[b, h, i, j] = score_mod(s[b, h, i, j], t(b), t(h), t(i), t(j))
    return s.masked_fill(~allowed, -math.inf)


def _row_softmax(s, allowed, sinks):
    """probs (B, H, L, S) and sink probs (B, H, L); rows without allowed keys are all zero."""
    b_size, h_size, l_size, _ = s.shape
    probs_rows, sink_rows = [], []
    for b in range(b_size):
        for h in range(h_size):
            for i in range(l_size):
                row = s[b, h, i]
                if not bool(allowed[b, h, i].any()):
                    probs_rows.append(torch.zeros_like(row))
                    sink_rows.append(torch.zeros((), dtype=s.dtype))
                    continue
                logits = row[allowed[b, h, i]]
                if sinks is not None:
                    logits = torch.cat([logits, sinks[h].to(torch.float64).reshape(1)])
                p = torch.exp(logits - torch.logsumexp(logits, 0))
                full = torch.zeros_like(row).masked_scatter(
                    allowed[b, h, i], p[: int(allowed[b, h, i].sum())]
                )
                probs_rows.append(full)
                sink_rows.append(p[-1] if sinks is not None else torch.zeros((), dtype=s.dtype))
    probs = torch.stack(probs_rows).reshape(s.shape)
    sink_probs = torch.stack(sink_rows).reshape(b_size, h_size, l_size)
    return probs, sink_probs


def reference_stats(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    causal_align: str = "top_left",
    window: tuple[int, int] = (-1, -1),
    chunk: int = 0,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    score_mod: Callable | None = None,
    block_mask=None,
) -> dict[str, torch.Tensor]:
    """Per-head max |logit|, entropy, sink mass and row count; see the module docstring for definitions."""
    with torch.no_grad():
        q, k = q.detach().cpu(), k.detach().cpu()
        sinks = None if sinks is None else sinks.detach().cpu()
        allowed, bias = reference_masks(
            q,
            k,
            causal=causal,
            causal_align=causal_align,
            window=window,
            chunk=chunk,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            alibi_slopes=None if alibi_slopes is None else alibi_slopes.detach().cpu(),
            attn_mask=None if attn_mask is None else attn_mask.detach().cpu(),
            block_mask=block_mask,
        )
        x = _raw_logits(q, k, scale)
        s = _final_scores(x, allowed, bias, softcap, score_mod)
        probs, sink_probs = _row_softmax(s, allowed, sinks)
        h_size = q.shape[1]
        max_logit = torch.zeros(h_size, dtype=torch.float64)
        entropy = torch.zeros(h_size, dtype=torch.float64)
        sink_mass = torch.zeros(h_size, dtype=torch.float64)
        rows = torch.zeros(h_size, dtype=torch.int64)
        for h in range(h_size):
            a = allowed[:, h]
            if bool(a.any()):
                max_logit[h] = x[:, h][a].abs().max()
            has_key = a.any(-1)  # (B, L)
            n = int(has_key.sum())
            rows[h] = n
            if n:
                p = probs[:, h][has_key]  # (n, S)
                ps = sink_probs[:, h][has_key]  # (n,)
                ent = -(torch.special.xlogy(p, p).sum(-1) + torch.special.xlogy(ps, ps))
                entropy[h] = ent.mean()
                sink_mass[h] = ps.mean()
        return {
            "max_logit": max_logit,
            "entropy": entropy,
            "sink_mass": sink_mass,
            "rows": rows,
            "allowed": allowed,
            "scores": s,
            "probs": probs,
            "sink_probs": sink_probs,
        }


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = False,
    causal_align: str = "top_left",
    window: tuple[int, int] = (-1, -1),
    chunk: int = 0,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    block_mask=None,
) -> torch.Tensor:
    """float64 attention output (B, H, L, Ev) = probs @ v with the same masks; differentiable in q, k, v, sinks.

    Rows with no allowed key give zeros. (No score_mod here: it is applied per entry in reference_stats.)
    """
    allowed, bias = reference_masks(
        q.detach().cpu(),
        k.detach().cpu(),
        causal=causal,
        causal_align=causal_align,
        window=window,
        chunk=chunk,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        alibi_slopes=None if alibi_slopes is None else alibi_slopes.detach().cpu(),
        attn_mask=None if attn_mask is None else attn_mask.detach().cpu(),
        block_mask=block_mask,
    )
    allowed, bias = allowed.to(q.device), bias.to(q.device)
    x = _raw_logits(q, k, scale)
    s = softcap * torch.tanh(x / softcap) if softcap > 0 else x
    s = (s + bias).masked_fill(~allowed, -math.inf)
    if sinks is not None:
        col = sinks.to(torch.float64)[None, :, None, None].expand(*s.shape[:-1], 1)
        s = torch.cat([s, col], dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows that are all -inf -> zeros
    if sinks is not None:
        p = p[..., :-1]
    h_size = q.shape[1]
    v64 = v.to(torch.float64).repeat_interleave(h_size // v.shape[1], dim=1)
    return p @ v64
