"""Init-time depth sweep (Xiong et al. 2020, Theorem 1): the last layer's ‖∂L/∂W₂‖ per depth.

At initialization, the gradient of the last block's second MLP matrix shrinks like 1/√L for
pre-norm and does not shrink (grows slightly) for post-norm; that is why post-norm needs warmup
while pre-norm does not. Runs in the worker before a variant trains: a few forward/backward passes
of freshly built models, no optimizer step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ...data import ByteCorpus
from ...models import GPT, GPTConfig
from ..spec.schema import DepthSpec


def last_layer_grad_norm(
    cfg: GPTConfig,
    interventions: Mapping[str, Mapping[str, Any]],
    corpus: ByteCorpus,
    batch_size: int,
    seed: int,
    device: torch.device | str = "cpu",
) -> float:
    """‖∇W₂‖_F of the last block's MLP output matrix (`blocks.{L-1}.mlp.proj.weight`) at init."""
    from ....interventions import apply_many

    torch.manual_seed(seed)
    model = GPT(cfg)
    if interventions:
        apply_many(model, {k: dict(v) for k, v in interventions.items()})
    model.to(device)
    x, y = corpus.batch("train", batch_size, cfg.context, torch.Generator().manual_seed(seed))  # (B, T)
    logits = model(x.to(device))  # (B, T, V)
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.to(device).reshape(-1)).backward()
    weight = model.get_parameter(f"blocks.{cfg.n_layers - 1}.mlp.proj.weight")
    assert weight.grad is not None
    return float(weight.grad.norm())


def depth_sweep(
    cfg: GPTConfig,
    interventions: Mapping[str, Mapping[str, Any]],
    spec: DepthSpec,
    corpus: ByteCorpus,
    batch_size: int,
    seed: int,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Mean last-layer grad norm per depth in `spec.layers` (over `spec.repeats` seeds), and the
    ratio deep / shallow that a check reads as `depth_grad_ratio`."""
    norms = []
    for layers in spec.layers:
        deep = cfg.updated(n_layers=layers)
        values = [
            last_layer_grad_norm(deep, interventions, corpus, batch_size, seed + r, device)
            for r in range(spec.repeats)
        ]
        norms.append(sum(values) / len(values))
    by_depth = dict(zip(spec.layers, norms))
    return {
        "layers": list(spec.layers),
        "grad_norm": norms,
        "ratio_depths": list(spec.ratio),
        "depth_grad_ratio": by_depth[spec.ratio[1]] / by_depth[spec.ratio[0]],
    }
