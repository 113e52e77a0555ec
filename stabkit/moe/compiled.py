"""The MoE probe under torch.compile: one opaque op, ``stabkit::moe_stats``, whose body is the eager
routing statistics (`stabkit.moe.stats.routing_stats`).

Traced into the model's graph by the MoE probe's forward hook; at run time the op asks the sampling
phase's gate (`stabkit.stats.opaque.gate_open`), so one graph serves sampled and unsampled steps and no
graph breaks. It returns one packed float32 vector — the load (E,), the means (`MEANS`), the maxima
(`MAXES`) and the count 1 (zeros on a step it does not measure) — that the probe records with
`Recorder.add_packed`, reduced and combined as in eager mode.
"""

from __future__ import annotations

from typing import Any

import torch

from ..stats.opaque import gate_open, opaque_fake, opaque_op
from ..stats.recorder import Combine, Reduction
from .map import Scoring
from .stats import MAXES, MEANS, routing_stats

SCORINGS: tuple[Scoring, ...] = ("softmax", "sigmoid", "logits")
"""`Scoring` by its index (the op's schema takes an int)."""


def packed_size(n_experts: int) -> int:
    """Length of the op's vector: E loads, the means, the maxima and the count."""
    return n_experts + len(MEANS) + len(MAXES) + 1


def packed_combines(n_experts: int) -> tuple[Combine, ...]:
    """How each entry combines over micro-batches: loads summed, means averaged, maxima kept."""
    kinds: list[Any] = ["sum"] * n_experts + ["mean"] * len(MEANS) + ["max"] * len(MAXES)
    return tuple(kinds)


def packed_reductions(n_experts: int) -> tuple[Reduction, ...]:
    """How each entry reduces over ranks: as it combines (the same names: sum, mean, max)."""
    same: tuple[Any, ...] = packed_combines(n_experts)
    return same


@opaque_op(
    "moe_stats",
    "(Tensor logits, Tensor? indices, Tensor? bias, int n_experts, int top_k, int scoring, int gate, int every)"
    " -> Tensor",
)
def moe_stats_packed(
    logits: torch.Tensor,
    indices: torch.Tensor | None,
    bias: torch.Tensor | None,
    n_experts: int,
    top_k: int,
    scoring: int,
    gate: int,
    every: int,
) -> torch.Tensor:
    """The packed routing statistics of one router call (see the module docstring)."""
    if not gate_open(gate, every):
        return torch.zeros(packed_size(n_experts), device=logits.device)
    with torch.no_grad():
        load, means, maxes = routing_stats(logits, indices, n_experts, top_k, SCORINGS[scoring], bias)
        return torch.cat([load, means, maxes, torch.ones(1, device=load.device)])


@opaque_fake("moe_stats")
def _(
    logits: torch.Tensor,
    indices: torch.Tensor | None,
    bias: torch.Tensor | None,
    n_experts: int,
    top_k: int,
    scoring: int,
    gate: int,
    every: int,
) -> torch.Tensor:
    return logits.new_empty((packed_size(n_experts),), dtype=torch.float32)
