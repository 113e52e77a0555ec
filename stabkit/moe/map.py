"""`MoEMap`: where one mixture-of-experts layer keeps its router, its experts and its routing outputs.

Built once at discovery time (`stabkit.moe.find` from the traced forward, or `stabkit.moe.registry`
for a router the user registered); held in `ModelMap.moe`; read by the MoE probe at attach. A leaf:
it imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch

Scoring = Literal["softmax", "sigmoid", "logits"]
"""What the router's top-k selects on: softmax(logits) (Mixtral, Qwen-MoE, OLMoE, Jamba), sigmoid(logits)
(DeepSeek-V3), or the logits themselves (GPT-OSS, GraniteMoE, Llama 4, which normalise after the choice)."""


@dataclass
class Where:
    """A tensor in a module's output: the output itself (`key` None) or item `key` of a tuple/list."""

    path: str
    """Module whose output holds it."""
    key: int | None = None

    def take(self, output: Any) -> torch.Tensor | None:
        """The tensor in `output` (the output of the module at `path`), or None when it is not there."""
        if self.key is None:
            return output if isinstance(output, torch.Tensor) else None
        if isinstance(output, tuple | list) and len(output) > self.key:
            item = output[self.key]
            return item if isinstance(item, torch.Tensor) else None
        return None


@dataclass
class MoEMap:
    """One MoE layer (see the module docstring). Paths are `named_modules()` paths from the root."""

    path: str
    """The MoE layer: the module whose output combines the chosen experts (the block's MLP slot)."""
    router: str
    """The module whose forward makes the gate projection and the top-k choice."""
    n_experts: int
    """E: the experts the router chooses among."""
    top_k: int
    """k: experts chosen per token."""
    gate_weight: str | None = None
    """The gate's (E, d) parameter: the projection whose E outputs the choice is made on."""
    gate: str | None = None
    """The module whose output is the gate projection, when one is (an nn.Linear gate, or the router)."""
    scoring: Scoring = "softmax"
    """What the top-k selects on (see `Scoring`)."""
    score_bias: str | None = None
    """A parameter or buffer of shape (E,) added to the scores for the choice (DeepSeek-V3's
    ``e_score_correction_bias``); None when there is none."""
    grouped: bool = False
    """The choice is limited to groups of experts (DeepSeek-V3's ``n_group`` / ``topk_group``)."""
    experts: str | None = None
    """The routed experts (a fused module, or the container of per-expert modules)."""
    shared_experts: list[str] = field(default_factory=list)
    """Experts every token goes through (DeepSeek, Qwen2-MoE, Llama 4)."""
    logits: Where | None = None
    """Where the router logits (T, E) are read; None: not reachable (no statistic for this layer)."""
    indices: Where | None = None
    """Where the chosen experts (T, k) are read; None: recomputed from the logits (same top-k as the
    router's, on the same scores), which is exact unless the choice is grouped."""
    found: str = "traced"
    """'traced' (seen in one forward) or 'registered' (`stabkit.register_router`)."""

    def describe(self) -> str:
        """One line for `ModelMap.describe` (what `stabkit inspect` prints)."""

        def at(w: Where | None) -> str:
            if w is None:
                return "recomputed"
            return f"{w.path}" + (f"[{w.key}]" if w.key is not None else "")

        bias = f" bias={self.score_bias}" if self.score_bias else ""
        shared = f" shared={','.join(self.shared_experts)}" if self.shared_experts else ""
        group = ", grouped" if self.grouped else ""
        return (
            f"  moe: {self.path}  router={self.router} gate={self.gate_weight} E={self.n_experts} "
            f"k={self.top_k} ({self.scoring}{group}){bias} experts={self.experts}{shared} "
            f"logits={at(self.logits) if self.logits else '-'} indices={at(self.indices)} [{self.found}]"
        )

    def under(self, prefix: str) -> MoEMap:
        """This map with every path put under `prefix` (found on a submodule)."""
        if not prefix:
            return self

        def j(path: str | None) -> str | None:
            return None if path is None else (f"{prefix}.{path}" if path else prefix)

        def w(x: Where | None) -> Where | None:
            return None if x is None else Where(j(x.path) or prefix, x.key)

        return replace(
            self,
            path=j(self.path) or prefix,
            router=j(self.router) or prefix,
            gate_weight=j(self.gate_weight),
            gate=j(self.gate),
            score_bias=j(self.score_bias),
            experts=j(self.experts),
            shared_experts=[j(s) or prefix for s in self.shared_experts],
            logits=w(self.logits),
            indices=w(self.indices),
        )
