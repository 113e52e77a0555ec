"""litgpt (Lightning AI) GPTs built from `litgpt.config.Config` (2 layers: 2 attention calls).

litgpt is not part of the zoo's install: every litgpt release pins ``huggingface-hub<1.4`` (0.5.13) or
``<0.35`` (older), while transformers 5.x needs ``huggingface-hub>=1.31``. These entries skip with an
ImportError unless litgpt is installed by hand (``pip install --no-deps litgpt`` imports fine here).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from .base import VOCAB, ZooModel, finish, require, token_ce, tokens

BUILDERS: dict[str, Callable[[], ZooModel]] = {}
_INSTALL = "not installed by the zoo: litgpt pins huggingface-hub<1.4, transformers needs >=1.31; try pip install --no-deps litgpt"

_COMMON: dict[str, Any] = {
    "block_size": 16,
    "vocab_size": VOCAB,
    "padded_vocab_size": VOCAB,
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 32,
}


def _gpt(config: dict[str, Any], notes: str) -> ZooModel:
    require("litgpt", _INSTALL)
    from litgpt.config import Config
    from litgpt.model import GPT

    torch.manual_seed(0)
    model = finish(GPT(Config(**_COMMON, **config)))
    ce = token_ce(tokens())
    return ZooModel(
        model=model,
        inputs={},
        args=(tokens(),),
        loss_fn=ce,
        logits_fn=lambda out: out,
        n_attention_calls=2,
        notes=notes,
        n_classes=VOCAB,
    )


BUILDERS["litgpt-llama"] = partial(
    _gpt,
    {
        "n_query_groups": 2,
        "rotary_percentage": 1.0,
        "parallel_residual": False,
        "bias": False,
        "norm_class_name": "RMSNorm",
        "mlp_class_name": "LLaMAMLP",
        "intermediate_size": 64,
    },
    "Llama layout: GQA (4 q / 2 kv heads) in one fused qkv Linear, RoPE, RMSNorm, SDPA",
)
BUILDERS["litgpt-pythia"] = partial(
    _gpt,
    {
        "rotary_percentage": 0.25,
        "parallel_residual": True,
        "bias": True,
        "norm_class_name": "LayerNorm",
        "mlp_class_name": "GptNeoxMLP",
        "intermediate_size": 128,
    },
    "Pythia layout: parallel residual, partial rotary (0.25), LayerNorm, SDPA",
)
BUILDERS["litgpt-gemma2"] = partial(
    _gpt,
    {
        "n_query_groups": 2,
        "head_size": 8,
        "rotary_percentage": 1.0,
        "parallel_residual": False,
        "bias": False,
        "norm_class_name": "RMSNorm",
        "mlp_class_name": "GemmaMLP",
        "intermediate_size": 64,
        "post_attention_norm": True,
        "post_mlp_norm": True,
        "attention_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "Gemma-2 layout: sandwich norms, attention soft cap 50 (eager q @ kᵀ, softmax), final logit soft cap",
)
