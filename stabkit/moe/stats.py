"""Routing statistics of one MoE layer's forward, as device tensors (no host sync).

Runs in the MoE probe's forward hook on sampled training forwards (`stabkit.moe.probe`). From the router
logits (T, E) and the chosen experts (T, k):

- ``load`` (E,): tokens per expert, counted with ``index_add_`` (``bincount`` would read the largest
  index on the host on CUDA) — a choice of the same expert by two slots of one token counts twice;
- ``entropy``: mean over tokens of the entropy (nats) of the router's distribution over the E experts
  — softmax(logits), or the sigmoid scores normalised to sum 1 for a sigmoid router;
- ``margin``: mean over tokens of the k-th minus the (k+1)-th largest score the choice is made on
  (softmax probabilities, sigmoid scores plus the score bias, or the logits) — how close the choice is
  to flipping; group limits (DeepSeek-V3) are not applied to it;
- ``logz_mean`` / ``logz_max``: logsumexp of the router logits per token (what ST-MoE's router z-loss
  squares), mean and max over tokens; ``logit_max``: the largest router logit.

The ratios of the load (MaxVio, CV, busiest share, dead experts) are taken on the host after the
counts are summed over micro-batches and ranks (`stabkit.moe.finish`).
"""

from __future__ import annotations

import torch

from ..stats.reductions import logz_chunk_rows
from .map import Scoring

MEANS = ("entropy", "margin", "logz_mean")
"""Statistics averaged over tokens (and micro-batches, ranks)."""
MAXES = ("logz_max", "logit_max")
"""Statistics whose maximum is kept."""


def selection_scores(logits: torch.Tensor, scoring: Scoring, bias: torch.Tensor | None) -> torch.Tensor:
    """(T, E) float32: what the router's top-k selects on."""
    if scoring == "softmax":
        scores = logits.softmax(-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:
        scores = logits
    return scores + bias.float() if bias is not None else scores


def routing_stats(
    logits: torch.Tensor,
    indices: torch.Tensor | None,
    n_experts: int,
    top_k: int,
    scoring: Scoring,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(load (E,), means (3,) as `MEANS`, maxes (2,) as `MAXES`), float32 on the logits' device.
    `indices` None: the choice is recomputed as the top-k of `selection_scores`."""
    flat = logits.detach().reshape(-1, n_experts)  # (T, E)
    rows = max(1, flat.shape[0])
    load = flat.new_zeros(n_experts, dtype=torch.float32)
    sums = flat.new_zeros(3, dtype=torch.float32)
    maxes = flat.new_full((2,), float("-inf"), dtype=torch.float32)
    chosen = indices.detach().reshape(-1, top_k) if indices is not None else None
    step = logz_chunk_rows(*flat.shape)
    for start in range(0, flat.shape[0], step):
        x = flat[start : start + step].float()  # (t, E)
        scores = selection_scores(x, scoring, bias)
        top = scores.topk(min(top_k + 1, n_experts), dim=-1)
        picked = chosen[start : start + step] if chosen is not None else top.indices[:, :top_k]
        load.index_add_(0, picked.reshape(-1), torch.ones(picked.numel(), device=x.device))
        if scoring == "sigmoid":
            s = x.sigmoid()
            p = s / s.sum(-1, keepdim=True)
        else:
            p = x.softmax(-1)
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # (t,)
        margin = top.values[:, top_k - 1] - top.values[:, top_k] if top_k < n_experts else entropy * 0
        logz = torch.logsumexp(x, -1)  # (t,)
        sums += torch.stack([entropy.sum(), margin.sum(), logz.sum()])
        maxes = torch.maximum(maxes, torch.stack([logz.amax(), x.amax()]))
    return load, sums / rows, maxes
