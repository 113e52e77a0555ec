"""The reference GPT's mixture-of-experts MLP: a top-k softmax router and E experts.

Runs in the block's forward in place of the dense MLP when ``GPTConfig.n_experts`` >= 2. Module names
are stable: ``blocks.{i}.mlp`` (`MoE`), ``.router`` (`Router`, its gate ``.router.gate``, a Linear with
E outputs), ``.experts.{e}`` (each an `MLP`). stabkit finds the router by behaviour
(`stabkit.moe.find`); nothing here is read by name.

No balancing loss is built in: the ``load_balance_loss``, ``router_z_loss`` and ``aux_free_balance``
interventions add one to the model as it is.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPTConfig
from .layers import MLP


class Router(nn.Module):
    """``gate`` (Linear d -> E) -> softmax (float32) -> top-k; the chosen probabilities renormalised to
    sum 1 (Mixtral). ``forward(x (N, d)) -> (logits (N, E), weights (N, k), indices (N, k))``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.gate = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.gate(x)  # (N, E)
        probs = logits.float().softmax(-1)
        weights, indices = probs.topk(self.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(x.dtype), indices


def capacity_mask(indices: torch.Tensor, n_experts: int, factor: float) -> torch.Tensor:
    """(N, k) bool: the token slots each expert keeps when it takes at most ceil(factor·N·k/E):
    first choices first (all tokens' slot 0, then slot 1, ...), in token order within a slot."""
    n, k = indices.shape
    capacity = math.ceil(factor * n * k / n_experts)
    order = indices.t().reshape(-1)  # (k·N,): slot-major
    onehot = F.one_hot(order, n_experts)  # (k·N, E)
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # place of each slot in its expert's queue
    return (position < capacity).reshape(k, n).t()


class MoE(nn.Module):
    """``forward(x (B, T, d)) -> (B, T, d)``: each token's k chosen experts, weighed by the router."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_experts = cfg.n_experts
        self.capacity_factor = cfg.capacity_factor
        self.router = Router(cfg)
        width = cfg.expert_d_ff or cfg.ff_width
        self.experts = nn.ModuleList(MLP(cfg, width) for _ in range(cfg.n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, d)
        _, weights, indices = self.router(flat)  # (N, k) each
        keep = None
        if self.capacity_factor is not None:
            keep = capacity_mask(indices, self.n_experts, self.capacity_factor)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            hit = indices == e if keep is None else (indices == e) & keep  # (N, k)
            token, slot = hit.nonzero(as_tuple=True)
            if token.numel() == 0:
                continue
            y = expert(flat[token]) * weights[token, slot, None]
            out = out.index_add(0, token, y)
        return out.reshape(x.shape)
