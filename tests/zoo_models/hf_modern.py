"""Recent Hugging Face architectures at tiny size: latent attention (MLA), attention sinks, sliding / chunked
windows, NoPE layers, mixtures of experts, hybrids where only some layers attend, a speech encoder-decoder
and image-text contrastive models.

One entry per attention implementation transformers runs on a CPU ("sdpa" and "eager"); transformers 5.24
refuses ``attn_implementation="sdpa"`` for GPT-OSS (``_supports_sdpa = False``: its sinks need eager or
flex attention). Hybrids run the pure-PyTorch fallbacks of their Mamba / short-convolution / gated-DeltaNet
mixers (``mamba_ssm``, ``causal_conv1d`` and ``fla`` are not installed); a mixer layer makes no attention call.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from ._hf import IMPLEMENTATIONS, LLAMA_LIKE, register
from .base import BATCH, SEQ, VOCAB, ZooModel, finish, require, token_ce, tokens

BUILDERS: dict[str, Callable[[], ZooModel]] = {}

EAGER_ONLY = ("eager",)


def _causal(
    name: str, config_name: str, model_name: str, n_calls: int, notes: str, config: dict, **kw
) -> None:
    register(BUILDERS, name, config_name, model_name, "causal", n_calls, notes, config, **kw)


# ------------------------------------------------------------------------------- latent attention (MLA)
_MLA = {
    **LLAMA_LIKE,
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 6,
    "moe_intermediate_size": 16,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
}
_causal(
    "deepseek-v3",
    "DeepseekV3Config",
    "DeepseekV3ForCausalLM",
    2,
    "MLA: low-rank q (q_a_proj -> RMSNorm -> q_b_proj) and a shared kv latent (kv_a_proj_with_mqa -> RMSNorm -> "
    "kv_b_proj); q = [q_nope (8) | q_rope (4)], k = [k_nope (8, per head) | k_rope (4, one head broadcast)], "
    "v head dim 6 != qk head dim 12, scale 12**-0.5, interleaved RoPE; layer 0 dense MLP, layer 1 MoE "
    "(4 routed experts top-2 with sigmoid group router + 1 shared expert)",
    {**_MLA, "q_lora_rank": 16, "n_group": 2, "topk_group": 1, "rope_interleave": True},
)
_causal(
    "deepseek-v2",
    "DeepseekV2Config",
    "DeepseekV2ForCausalLM",
    2,
    "MLA without a q latent (q_lora_rank=None: one q_proj), complex-number RoPE on the 4 rope dims; "
    "layer 0 dense MLP, layer 1 MoE (4 routed experts top-2 greedy softmax router + 1 shared expert)",
    {**_MLA, "q_lora_rank": None},
)

# ------------------------------------------------------------------------------------------------- sinks
_causal(
    "gpt-oss",
    "GptOssConfig",
    "GptOssForCausalLM",
    2,
    "learned per-head sink logit concatenated to each row of the logits inside the softmax (eager: "
    "softmax(cat([q·kᵀ·s + mask, sink]) - row max), sink column dropped: the softmax input is shifted, its "
    "max is 0), sliding (window 4) / full layers, YaRN RoPE (factor 4: cos/sin scaled by 1.139), MoE in every "
    "layer (4 experts top-2, clamped SwiGLU, router softmax over the top-k), qkv and o biases, GQA",
    {
        **LLAMA_LIKE,
        "head_dim": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 8,
        },
    },
    impls=EAGER_ONLY,  # transformers 5.24: GptOssPreTrainedModel._supports_sdpa = False
)

# ---------------------------------------------------------------------------- sliding / chunked windows
_causal(
    "gemma3",
    "Gemma3TextConfig",
    "Gemma3ForCausalLM",
    2,
    "sliding (window 4, local RoPE base) / global layers, QK-norm ((1 + w) RMSNorm per head), sandwich norms, "
    "query_pre_attn_scalar 8, embeddings scaled by sqrt(d), tied head",
    {
        **LLAMA_LIKE,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "query_pre_attn_scalar": 8,
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention"],
        "pad_token_id": 0,
    },
)
_causal(
    "llama4",
    "Llama4TextConfig",
    "Llama4ForCausalLM",
    2,
    "layer 0: chunked attention (chunks of 4 < seq 12), RoPE, weightless L2 QK-norm, dense MLP; layer 1: NoPE "
    "with full causal attention and attention temperature tuning (q scaled by position), MoE (4 experts "
    "top-1, sigmoid router, shared expert)",
    {
        **LLAMA_LIKE,
        "head_dim": 8,
        "intermediate_size_mlp": 64,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 2,
        "no_rope_layer_interval": 2,
        "attention_chunk_size": 4,
        "floor_scale": 4,
    },
)
_causal(
    "cohere2",
    "Cohere2Config",
    "Cohere2ForCausalLM",
    2,
    "sliding (window 4, RoPE) / global (NoPE) layers, parallel residual (attention and MLP read one "
    "LayerNorm), logit_scale 0.0625, tied head, GQA",
    {**LLAMA_LIKE, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
)

# --------------------------------------------------------------------------------------------------- NoPE
_causal(
    "smollm3",
    "SmolLM3Config",
    "SmolLM3ForCausalLM",
    2,
    "NoPE every 2nd layer (no_rope_layers=[1, 0]: layer 1 has no RoPE), GQA, tied head",
    {**LLAMA_LIKE, "no_rope_layer_interval": 2},
)

# ---------------------------------------------------------------------------------------------------- MoE
_causal(
    "qwen3-moe",
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    2,
    "MoE in every layer (4 experts top-2, softmax router, experts as 3-d parameters), QK-norm, GQA",
    {
        **LLAMA_LIKE,
        "head_dim": 8,
        "moe_intermediate_size": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    },
)

# ------------------------------------------------------------------------------------------------ hybrids
_causal(
    "jamba",
    "JambaConfig",
    "JambaForCausalLM",
    1,
    "hybrid: layer 0 Mamba (pure-PyTorch selective scan) + MoE (4 experts top-2), layer 1 attention (no RoPE) "
    "+ dense MLP; 1 attention call",
    {
        **LLAMA_LIKE,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 0,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "use_mamba_kernels": False,
        "mamba_d_state": 4,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": 4,
    },
)
_MAMBA2 = {
    "mamba_n_heads": 4,
    "mamba_d_head": 16,
    "mamba_n_groups": 1,
    "mamba_d_state": 8,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 4,
}
_causal(
    "bamba",
    "BambaConfig",
    "BambaForCausalLM",
    1,
    "hybrid: layer 0 Mamba2 (pure-PyTorch chunked scan), layer 1 attention with partial RoPE; 1 attention call",
    {**LLAMA_LIKE, **_MAMBA2, "attn_layer_indices": [1]},
)
_causal(
    "zamba2",
    "Zamba2Config",
    "Zamba2ForCausalLM",
    2,
    "hybrid with ONE shared transformer block (attention + MLP over concat(hidden, input embeddings), "
    "64 wide) called from both hybrid layers 1 and 3 (per-call LoRA-free), Mamba2 in every layer; "
    "2 attention calls from 1 attention module",
    {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"],
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_mamba_heads": 4,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_ngroups": 1,
        "chunk_size": 4,
        "use_mamba_kernels": False,
        "num_mem_blocks": 1,
        "max_position_embeddings": 32,
        "attention_dropout": 0.0,
        "use_cache": False,
    },
)
_causal(
    "falcon-h1",
    "FalconH1Config",
    "FalconH1ForCausalLM",
    2,
    "parallel hybrid: every layer runs attention and Mamba2 side by side on one RMSNorm output and adds both, "
    "key_multiplier 0.5 inside k, muP multipliers on embeddings / lm head",
    {
        **LLAMA_LIKE,
        **_MAMBA2,
        "mamba_d_ssm": 64,
        "key_multiplier": 0.5,
        "embedding_multiplier": 2.0,
        "lm_head_multiplier": 0.5,
    },
)
_causal(
    "granitemoehybrid",
    "GraniteMoeHybridConfig",
    "GraniteMoeHybridForCausalLM",
    1,
    "hybrid: layer 0 Mamba2, layer 1 attention (NoPE, attention_multiplier 0.5); MoE (4 experts top-2) + "
    "shared MLP in both layers; residual / embedding / logits multipliers; 1 attention call",
    {
        **LLAMA_LIKE,
        **_MAMBA2,
        "layer_types": ["mamba", "attention"],
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "shared_intermediate_size": 32,
        "attention_multiplier": 0.5,
        "residual_multiplier": 0.5,
        "embedding_multiplier": 2.0,
        "logits_scaling": 2.0,
    },
)
_causal(
    "qwen3-next",
    "Qwen3NextConfig",
    "Qwen3NextForCausalLM",
    1,
    "hybrid: layer 0 gated DeltaNet linear attention (pure-PyTorch chunked delta rule, no softmax), layer 1 "
    "gated full attention (q_proj emits q and a sigmoid output gate, QK-norm, partial RoPE); MoE (4 experts "
    "top-2 + gated shared expert) in both layers; 1 attention call",
    {
        **LLAMA_LIKE,
        "head_dim": 8,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
    },
)
_causal(
    "lfm2",
    "Lfm2Config",
    "Lfm2ForCausalLM",
    1,
    "hybrid: layer 0 gated short convolution (kernel 3), layer 1 attention with QK-norm (per-head RMSNorm); "
    "1 attention call",
    {
        **LLAMA_LIKE,
        "layer_types": ["conv", "full_attention"],
        "conv_L_cache": 3,
        "block_auto_adjust_ff_dim": False,
        "block_ff_dim": 64,
    },
)


# ------------------------------------------------------------------------------- speech encoder-decoder
_MEL_BINS = 8
_SOURCE_POSITIONS = 8  # encoder length after the stride-2 conv; input_features have 2 * 8 frames


def _whisper(impl: str) -> ZooModel:
    transformers = require("transformers")
    torch.manual_seed(0)
    cfg = transformers.WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=_MEL_BINS,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=_SOURCE_POSITIONS,
        max_target_positions=32,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        use_cache=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,
        suppress_tokens=[],
        begin_suppress_tokens=[],
        attn_implementation=impl,
    )
    model = _checked(finish(transformers.WhisperForConditionalGeneration(cfg)), impl)
    inputs = {
        "input_features": torch.randn(BATCH, _MEL_BINS, 2 * _SOURCE_POSITIONS),
        "decoder_input_ids": tokens(seq=SEQ - 2),
        "use_cache": False,
        "return_dict": True,
    }
    ce = token_ce(tokens(seq=SEQ - 2))
    return ZooModel(
        model=model,
        inputs=inputs,
        loss_fn=lambda out: ce(out.logits),
        logits_fn=lambda out: out.logits,
        n_attention_calls=6,
        notes="speech encoder-decoder: 2 conv1d (stride 1, 2) over 8 mel bins x 16 frames -> 8 positions, "
        "sinusoidal encoder positions, 2 encoder self (bidirectional), 2 decoder self (causal) and 2 cross "
        "calls; k_proj without bias, pre-norm with final encoder / decoder LayerNorms, learned decoder positions, "
        "tied head; inputs are input_features + decoder_input_ids (no input_ids); "
        f"attn={impl}",
        n_classes=VOCAB,
    )


# --------------------------------------------------------------------------------- image-text contrastive
_IMAGE = 16
_PATCH = 8  # 2 x 2 patches


def _contrastive(kind: str, impl: str) -> ZooModel:
    """CLIP / SigLIP: input_ids (B, 8) and pixel_values (B, 3, 16, 16) -> logits_per_image (B, B)."""
    transformers = require("transformers")
    torch.manual_seed(0)
    text = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 16,
        "attention_dropout": 0.0,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": _IMAGE,
        "patch_size": _PATCH,
        "attention_dropout": 0.0,
    }
    if kind == "clip":
        cfg = transformers.CLIPConfig(
            text_config={**text, "projection_dim": 16},
            vision_config={**vision, "projection_dim": 16},
            projection_dim=16,
            attn_implementation=impl,
        )
        model = transformers.CLIPModel(cfg)
    else:
        cfg = transformers.SiglipConfig(
            text_config=text, vision_config={**vision, "vision_use_head": True}, attn_implementation=impl
        )
        model = transformers.SiglipModel(cfg)
    model = _checked(finish(model), impl)
    ids = tokens(seq=8)
    ids[:, -1] = 2  # CLIP pools the text at the eos token
    inputs = {"input_ids": ids, "pixel_values": torch.randn(BATCH, 3, _IMAGE, _IMAGE), "return_dict": True}
    targets = torch.arange(BATCH)
    if kind == "clip":

        def loss(out: Any) -> torch.Tensor:  # symmetric contrastive cross entropy
            return (
                F.cross_entropy(out.logits_per_image, targets) + F.cross_entropy(out.logits_per_text, targets)
            ) / 2

        n_calls = 4
        notes = (
            "image-text contrastive: 2 text layers (causal mask, eos pooling) + 2 vision layers (CLS + 4 "
            "patches, pre-LayerNorm), projections, logits_per_image = exp(logit_scale) * cos-sim (B_img, B_txt); "
            "symmetric contrastive CE; 4 attention calls"
        )
    else:

        def loss(out: Any) -> torch.Tensor:  # pairwise sigmoid loss
            labels = 2 * torch.eye(BATCH) - 1
            return -F.logsigmoid(labels * out.logits_per_image.t()).sum() / BATCH

        n_calls = 5
        notes = (
            "image-text contrastive with sigmoid loss: 2 text layers (bidirectional, last-token pooling) + 2 "
            "vision layers (4 patches, no CLS) + a multihead-attention pooling head (nn.MultiheadAttention, "
            "1 learned probe query over 4 patches): 5 attention calls; logits = scale * cos-sim + bias"
        )
    return ZooModel(
        model=model,
        inputs=inputs,
        loss_fn=loss,
        logits_fn=lambda out: out.logits_per_image,
        n_attention_calls=n_calls,
        notes=f"{notes}; attn={impl}",
        n_classes=BATCH,
    )


def _checked(model: Any, impl: str) -> Any:
    got = model.config._attn_implementation
    if got != impl:
        raise AssertionError(f"{type(model).__name__}: asked for {impl!r} attention, got {got!r}")
    return model


for _impl in IMPLEMENTATIONS:
    BUILDERS[f"hf-whisper-{_impl}"] = partial(_whisper, _impl)
    BUILDERS[f"hf-clip-{_impl}"] = partial(_contrastive, "clip", _impl)
    BUILDERS[f"hf-siglip-{_impl}"] = partial(_contrastive, "siglip", _impl)
