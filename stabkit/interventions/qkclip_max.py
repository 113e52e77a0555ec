"""The exact per-head max attention logit that ``qk_clip`` compares with its threshold.

QK-Clip (Kimi K2, §2.1) clips a head when ``S_h = max over the step's batch of q·k·scale`` exceeds
τ, and then sets the logit to exactly τ. A sampled statistic (the attention probe's: a few rows and
queries) is a lower bound of S_h, so a head whose true max is past τ could go unclipped. This module
measures S_h exactly: at every attention call of a training forward it recomputes ``q·kᵀ·scale``
for *every* batch row, head, query and allowed key, in float32, in blocks whose temporaries stay
within a byte budget (the plan of `stabkit.attention.measure.blocks`), and keeps the **signed** max
over the allowed entries — K2's definition; the softmax's large negative logits are not clipped.

What it reads: the call's q and k through the same readers as the attention probe (SDPA,
``nn.MultiheadAttention``, the eager softmax, known kernels: `stabkit.attention.readers`,
`stabkit.attention.kernels.read_call`), with every mask the call carries (causal flags, windows,
documents, FlexAttention block masks); on the eager path the materialised softmax input itself
(masked entries and learned sink columns left out, a model's own soft cap inverted).

Cost: one extra float32 ``q·kᵀ`` per attention call per training forward, and no extra memory
beyond the block budget (`QKClipOptions.chunk_bytes`); `stabkit bench` has the figure.

When it runs: inside the attention module's forward (the intervention's own scope,
`stabkit.attention.scope.attach_scope`), under ``no_grad``; nothing syncs with the host.
"""

from __future__ import annotations

import torch

from ..attention.call import LogitsCall, QKCall
from ..attention.measure.blocks import QKBlocks, cost_logits, cost_qk, dims_of, plan, spans
from ..attention.measure.masks import IndexMask
from ..attention.measure.stats import fill_, uncap


@torch.no_grad()
def head_max(call: QKCall | LogitsCall, budget: int, cap: float | None = None) -> torch.Tensor:
    """(H,) float32 signed max logit of each head over every allowed entry of `call` (−inf for a head
    with none; NaN propagates). `cap`: the eager softmax input was soft-capped by the model at `cap`
    (the max is read back through the cap). Temporaries within `budget` bytes."""
    if isinstance(call, LogitsCall):
        top = _logits_max(call.x, call.sink_columns, budget)
        return uncap(top, cap) if cap is not None else top
    return _qk_max(call, budget)


def _qk_max(call: QKCall, budget: int) -> torch.Tensor:
    q, k = call.q, call.k  # (B, H, L, E), (B, Hkv, S, E)
    batch, n_q = max(q.shape[0], k.shape[0]), q.shape[2]
    index_mask = IndexMask.of(call)
    blocks = QKBlocks(
        q=q,
        k=k,
        scale=call.scale,
        allowed=call.allowed,
        bias=None,
        q_index=torch.arange(n_q, device=q.device).view(1, 1, -1),
        causal=call.causal,
        host_positions=range(n_q) if call.causal else None,
        row_index=torch.arange(batch, device=q.device) if index_mask is not None else None,
        index_mask=index_mask,
    )
    heads = q.shape[1]
    out = torch.full((heads,), -torch.inf, device=q.device)
    dims = (blocks.rows, k.shape[1], n_q, k.shape[2])
    group, dim = blocks.group, q.shape[-1]
    extra = index_mask.bytes_per_logit if index_mask is not None else 0
    sizes = plan(dims, lambda *s: cost_qk(*s, group=group, dim=dim, state=False, extra=extra), budget)
    row_spans, kv_spans, q_spans, k_spans = (spans(n, c) for n, c in zip(dims, sizes, strict=True))
    for rs in row_spans:
        for kv in kv_spans:
            hs = slice(kv.start * group, kv.stop * group)
            tops = [out[hs]]
            for qs in q_spans:
                for ks in k_spans:
                    if blocks.host_positions is not None and ks.start > blocks.last_query(qs):
                        continue  # causal: every key of the block comes after every query of it
                    logits = blocks.logits(rs, kv, qs, ks)  # (b, h, l, s) float32, own storage
                    blocked = blocks.blocked(rs, hs, qs, ks)
                    if blocked is not None:
                        fill_(logits, blocked, -torch.inf)
                    tops.append(logits.amax(dim=(0, 2, 3)))
                    del logits, blocked
            out[hs] = torch.stack(tops).amax(dim=0)
    return out


def _logits_max(x: torch.Tensor, sink_columns: int, budget: int) -> torch.Tensor:
    """(H,) signed max of a materialised (B, H, L, S) softmax input over its unmasked entries
    (> finfo.min/2), its last `sink_columns` columns (learned sinks) left out."""
    if sink_columns:
        x = x[..., : x.shape[-1] - sink_columns]
    threshold = torch.finfo(x.dtype).min / 2
    out = torch.full((x.shape[1],), -torch.inf, device=x.device)
    dims = dims_of(x)
    sizes = plan(dims, lambda *s: cost_logits(*s, itemsize=x.element_size(), state=False), budget)
    row_spans, h_spans, q_spans, k_spans = (spans(n, c) for n, c in zip(dims, sizes, strict=True))
    for rs in row_spans:
        for hs in h_spans:
            for qs in q_spans:
                for ks in k_spans:
                    part = x[rs, hs, qs, ks].float()
                    part = part.masked_fill(part <= threshold, -torch.inf)
                    out[hs] = torch.maximum(out[hs], part.amax(dim=(0, 2, 3)))
                    del part
    return out
