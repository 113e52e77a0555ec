"""Tiny Hugging Face mixture-of-experts models built from their config classes (no download), each
with the E and k its router must be found with. Imported by the tests in this folder."""

from __future__ import annotations

from typing import Any

import torch
import transformers
from torch import nn

BASE: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "attention_dropout": 0.0,
    "use_cache": False,
}

MODELS: dict[str, tuple[str, str, dict[str, Any], int, int, int]] = {
    # name: (config class, model class, config fields, MoE layers, E, k)
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2},
        2,
        4,
        2,
    ),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
        },
        2,
        6,
        2,
    ),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 8},
        2,
        4,
        2,
    ),
    "deepseek-v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            "num_key_value_heads": 4,
            "kv_lora_rank": 16,
            "q_lora_rank": 16,
            "qk_nope_head_dim": 8,
            "qk_rope_head_dim": 4,
            "v_head_dim": 6,
            "moe_intermediate_size": 16,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "n_group": 2,
            "topk_group": 1,
        },
        1,
        8,
        2,
    ),
    "gpt-oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 8,
            "layer_types": ["full_attention"] * 2,
        },
        2,
        4,
        2,
    ),
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        {
            "head_dim": 8,
            "intermediate_size_mlp": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 1,
        },
        2,
        4,
        1,
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}, 2, 4, 2),
    "granitemoe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2},
        2,
        4,
        2,
    ),
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        {
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 1,
            "expert_layer_offset": 0,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "use_mamba_kernels": False,
            "mamba_d_state": 4,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_dt_rank": 4,
        },
        2,
        4,
        2,
    ),
}


def build(name: str, seed: int = 0, **extra: Any) -> nn.Module:
    """The tiny model `name` (eager attention, in training mode)."""
    config_name, model_name, fields, *_ = MODELS[name]
    config = getattr(transformers, config_name)(**{**BASE, **fields, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    return model.train()


def tokens(seed: int = 0, batch: int = 2, seq: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, BASE["vocab_size"], (batch, seq), generator=g)
