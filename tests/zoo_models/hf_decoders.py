"""Hugging Face decoder-only causal LMs (2 layers each: 2 self-attention calls per forward)."""

from __future__ import annotations

from collections.abc import Callable

from ._hf import LLAMA_LIKE, register
from .base import VOCAB, ZooModel

BUILDERS: dict[str, Callable[[], ZooModel]] = {}

# transformers 5.24 raises for attn_implementation="sdpa" on Bloom, Gemma 2 and GPT-Neo.
EAGER_ONLY = ("eager",)
_NO_KV = {k: v for k, v in LLAMA_LIKE.items() if k != "num_key_value_heads"}


def _causal(name: str, config_name: str, model_name: str, notes: str, config: dict, **kw) -> None:
    register(BUILDERS, name, config_name, model_name, "causal", 2, notes, config, **kw)


_causal(
    "gpt2",
    "GPT2Config",
    "GPT2LMHeadModel",
    "fused qkv Conv1D (c_attn, contiguous q|k|v), pre-norm, learned positions, tied head",
    {
        "vocab_size": VOCAB,
        "n_positions": 32,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "use_cache": False,
    },
)
_causal("llama", "LlamaConfig", "LlamaForCausalLM", "GQA (4 q heads, 2 kv heads), RoPE, RMSNorm", LLAMA_LIKE)
_causal(
    "mistral",
    "MistralConfig",
    "MistralForCausalLM",
    "GQA, sliding window 8 < seq len 12",
    {**LLAMA_LIKE, "sliding_window": 8},
)
_causal("qwen2", "Qwen2Config", "Qwen2ForCausalLM", "GQA, qkv biases", LLAMA_LIKE)
_causal(
    "qwen3",
    "Qwen3Config",
    "Qwen3ForCausalLM",
    "GQA, QK-norm (per-head RMSNorm on q and k)",
    {**LLAMA_LIKE, "head_dim": 8},
)
_causal(
    "gemma",
    "GemmaConfig",
    "GemmaForCausalLM",
    "MQA-style GQA (1 kv head), (1 + w) RMSNorm, embeddings scaled by sqrt(d)",
    {**LLAMA_LIKE, "num_key_value_heads": 1, "head_dim": 8},
)
_causal(
    "gemma2",
    "Gemma2Config",
    "Gemma2ForCausalLM",
    "sandwich norms (pre + post norm around each sub-layer), attention soft cap 50, final logit soft cap 30, "
    "alternating sliding window / global layers, query_pre_attn_scalar",
    {
        **LLAMA_LIKE,
        "head_dim": 8,
        "query_pre_attn_scalar": 8,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "sliding_window": 8,
    },
    impls=EAGER_ONLY,
)
_causal(
    "cohere",
    "CohereConfig",
    "CohereForCausalLM",
    "parallel residual (attention and MLP read one LayerNorm), logit_scale after head (logits * 0.0625), "
    "tied head, GQA, interleaved RoPE",
    {**LLAMA_LIKE, "logit_scale": 0.0625},
)
_causal(
    "phi",
    "PhiConfig",
    "PhiForCausalLM",
    "parallel attention + MLP from one LayerNorm, partial rotary (0.5), dense output projection",
    {**_NO_KV, "partial_rotary_factor": 0.5, "resid_pdrop": 0.0, "embd_pdrop": 0.0},
)
_causal(
    "phi3",
    "Phi3Config",
    "Phi3ForCausalLM",
    "fused qkv Linear (contiguous q|k|v) with GQA, fused gate_up MLP",
    {**LLAMA_LIKE, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "pad_token_id": 0},
)
_causal(
    "olmo2",
    "Olmo2Config",
    "Olmo2ForCausalLM",
    "norms after sub-layers (x + norm(attn(x))), QK-norm over the full q/k width",
    LLAMA_LIKE,
)
_causal(
    "mixtral",
    "MixtralConfig",
    "MixtralForCausalLM",
    "MoE (4 experts, top-2 router softmax over 2-d logits), GQA",
    {**LLAMA_LIKE, "num_local_experts": 4, "num_experts_per_tok": 2},
)
_causal(
    "olmoe",
    "OlmoeConfig",
    "OlmoeForCausalLM",
    "MoE (4 experts, top-2), QK-norm",
    {**LLAMA_LIKE, "num_experts": 4, "num_experts_per_tok": 2},
)
_causal(
    "gptj",
    "GPTJConfig",
    "GPTJForCausalLM",
    "parallel residual (one LayerNorm), separate q/k/v without bias, interleaved rotary on 4 dims",
    {
        "vocab_size": VOCAB,
        "n_positions": 32,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "rotary_dim": 4,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "use_cache": False,
    },
)
_causal(
    "gpt-neox",
    "GPTNeoXConfig",
    "GPTNeoXForCausalLM",
    "interleaved fused qkv per head (query_key_value: [q_h k_h v_h] per head), parallel residual, "
    "partial rotary (0.25)",
    {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "rotary_pct": 0.25,
        "max_position_embeddings": 32,
        "attention_dropout": 0.0,
        "hidden_dropout": 0.0,
        "use_parallel_residual": True,
        "use_cache": False,
    },
)
_causal(
    "bloom",
    "BloomConfig",
    "BloomForCausalLM",
    "interleaved fused qkv per head, alibi position bias (baddbmm), embedding LayerNorm",
    {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "n_layer": 2,
        "n_head": 4,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "use_cache": False,
    },
    impls=EAGER_ONLY,
)
_causal(
    "falcon",
    "FalconConfig",
    "FalconForCausalLM",
    "MQA (1 kv head) in one fused qkv Linear, parallel attention + MLP, RoPE",
    {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "multi_query": True,
        "parallel_attn": True,
        "alibi": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "max_position_embeddings": 32,
        "use_cache": False,
    },
)
_causal(
    "falcon-new-arch",
    "FalconConfig",
    "FalconForCausalLM",
    "Falcon-40B layout: GQA (2 kv heads) with grouped fused qkv ([q.. k v] per kv group), two LayerNorms, "
    "parallel attention + MLP",
    {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_kv_heads": 2,
        "new_decoder_architecture": True,
        "alibi": False,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "max_position_embeddings": 32,
        "use_cache": False,
    },
)
_causal(
    "gpt-bigcode",
    "GPTBigCodeConfig",
    "GPTBigCodeForCausalLM",
    "MQA in a fused c_attn (q | k | v with one kv head), learned positions",
    {
        "vocab_size": VOCAB,
        "n_positions": 32,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "multi_query": True,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "use_cache": False,
    },
)
_causal(
    "opt",
    "OPTConfig",
    "OPTForCausalLM",
    "pre-norm, learned positions with offset 2, q pre-scaled by head_dim**-0.5 and attention called with scale=1",
    {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "ffn_dim": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 32,
        "word_embed_proj_dim": 32,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "layerdrop": 0.0,
        "use_cache": False,
    },
)
_causal(
    "gpt-neo",
    "GPTNeoConfig",
    "GPTNeoForCausalLM",
    "unscaled logits (no 1/sqrt(d)), alternating global / local (window 4) attention layers",
    {
        "vocab_size": VOCAB,
        "max_position_embeddings": 32,
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "attention_types": [[["global", "local"], 1]],
        "window_size": 4,
        "resid_dropout": 0.0,
        "embed_dropout": 0.0,
        "attention_dropout": 0.0,
        "use_cache": False,
    },
    impls=EAGER_ONLY,
)
_causal(
    "starcoder2",
    "Starcoder2Config",
    "Starcoder2ForCausalLM",
    "GQA, LayerNorm with bias, sliding window 8",
    {**LLAMA_LIKE, "sliding_window": 8, "residual_dropout": 0.0, "embedding_dropout": 0.0},
)
_causal(
    "granite",
    "GraniteConfig",
    "GraniteForCausalLM",
    "attention_multiplier as the logit scale (0.5), residual_multiplier, embedding_multiplier, "
    "logits divided by logits_scaling",
    {
        **LLAMA_LIKE,
        "attention_multiplier": 0.5,
        "residual_multiplier": 0.5,
        "embedding_multiplier": 4.0,
        "logits_scaling": 2.0,
    },
)
_causal(
    "stablelm",
    "StableLmConfig",
    "StableLmForCausalLM",
    "partial rotary (0.25), per-head QK LayerNorm, parallel residual",
    {
        **LLAMA_LIKE,
        "partial_rotary_factor": 0.25,
        "qk_layernorm": True,
        "use_parallel_residual": True,
        "hidden_dropout": 0.0,
    },
)
_causal(
    "persimmon",
    "PersimmonConfig",
    "PersimmonForCausalLM",
    "interleaved fused qkv per head, QK LayerNorm, partial rotary (0.5), squared ReLU",
    {**_NO_KV, "partial_rotary_factor": 0.5, "qk_layernorm": True, "hidden_dropout": 0.0},
)
_causal(
    "codegen",
    "CodeGenConfig",
    "CodeGenForCausalLM",
    "fused qkv_proj in mp_num=4 blocks (q, v, k order inside each block), parallel residual, rotary on 4 dims",
    {
        "vocab_size": VOCAB,
        "n_positions": 32,
        "n_ctx": 32,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "rotary_dim": 4,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "use_cache": False,
    },
)
