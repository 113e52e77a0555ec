"""`hf:<model_type>`: any causal-LM architecture the installed transformers knows, built from its config
class at the recipe's size (never a download).

Runs when a worker (or `stabkit inspect` / `bench`) builds the model. The config class's defaults give
the architecture (activation, norms, RoPE, MoE routing, soft caps); the recipe's size gives the shape,
written into the config's own fields: width, layers, heads, key/value heads (the default's ratio of
query to key/value heads kept, GQA stays GQA), head width, MLP width (the default's ratio to the width
kept, for the dense and the expert MLPs), vocabulary, positions. The user's options
(``--model-option num_local_experts=4``) go over all of that.
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from .config import GPTConfig
from .spec import ModelSpecError

RATIO_FIELDS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "n_inner")
"""MLP widths scaled with the model width (the default's ratio to ``hidden_size`` kept)."""
LATENT_FIELDS = ("kv_lora_rank", "q_lora_rank")
"""Low-rank attention widths (DeepSeek's MLA), scaled with the model width."""
HEAD_WIDTH_FIELDS = ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
"""Per-head widths of MLA, scaled with the head width (the default's ``head_dim``)."""


def transformers_module() -> Any:
    """transformers, or a ModelSpecError saying how to install it."""
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ModelSpecError(
            f"hf: model specs need Hugging Face transformers: pip install transformers ({exc})"
        ) from None
    return transformers


def causal_lm_types() -> list[str]:
    """Every model_type transformers can build a causal-LM head for."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def config_class(model_type: str) -> type:
    """The config class of `model_type`; an unknown type or one without a causal-LM head raises a
    one-line ModelSpecError with close matches."""
    transformers = transformers_module()
    from transformers import CONFIG_MAPPING

    types = causal_lm_types()
    if model_type not in types:
        import difflib

        close = difflib.get_close_matches(model_type, types, n=4) or types[:6]
        known = "has no causal-LM head" if model_type in CONFIG_MAPPING else "is not known"
        raise ModelSpecError(
            f"hf:{model_type} {known} in transformers {transformers.__version__}; "
            f"e.g. {', '.join('hf:' + t for t in close)}"
        )
    return CONFIG_MAPPING[model_type]


def sized_config(model_type: str, size: GPTConfig, options: dict[str, Any]) -> Any:
    """The config of `model_type` at the size of `size`, `options` over it."""
    cls = config_class(model_type)
    default = cls()
    fields = shape_fields(default, size)
    unknown = sorted(k for k in options if not has_field(default, k))
    if unknown:
        raise ModelSpecError(
            f"--model-option {', '.join(unknown)}: not a field of {cls.__name__} "
            f"(e.g. {', '.join(sorted(k for k in vars(default) if not k.startswith('_'))[:8])})"
        )
    heads = options.get("num_attention_heads", fields.get("num_attention_heads"))
    kv = options.get("num_key_value_heads", fields.get("num_key_value_heads"))
    if isinstance(heads, int) and isinstance(kv, int) and (kv < 1 or heads % kv):
        raise ModelSpecError(
            f"hf:{model_type}: num_key_value_heads={kv} must divide num_attention_heads={heads} "
            "(the recipe's n_heads at this size, unless an option sets it)"
        )
    try:
        return cls(**{**fields, **options})
    except (TypeError, ValueError) as exc:
        raise ModelSpecError(f"hf:{model_type} at this size: {' '.join(str(exc).split())}") from None


def has_field(config: Any, name: str) -> bool:
    return name in vars(config) or name in getattr(config, "attribute_map", {})


def shape_fields(default: Any, size: GPTConfig) -> dict[str, Any]:
    """Config fields that give the model the recipe's shape, named as the config class names them."""
    d, heads = size.d_model, size.n_heads
    width = getattr(default, "hidden_size", None) or d
    out: dict[str, Any] = {
        "hidden_size": d,
        "num_hidden_layers": size.n_layers,
        "num_attention_heads": heads,
        "vocab_size": size.vocab_size,
        "max_position_embeddings": size.context,
    }
    if has_field(default, "num_key_value_heads"):
        out["num_key_value_heads"] = size.n_kv_heads or kv_heads(default, heads)
    if getattr(default, "head_dim", None) is not None:
        out["head_dim"] = d // heads
    if getattr(default, "query_pre_attn_scalar", None) is not None:  # Gemma 2/3: 1/sqrt(head_dim)
        out["query_pre_attn_scalar"] = d // heads
    for name in RATIO_FIELDS:
        value = getattr(default, name, None)
        if isinstance(value, int) and value > 0:
            out[name] = size.d_ff if size.d_ff and name == "intermediate_size" else scaled(value, d, width)
    for name in LATENT_FIELDS:
        value = getattr(default, name, None)
        if isinstance(value, int) and value > 0:
            out[name] = scaled(value, d, width)
    default_head = getattr(default, "head_dim", None)
    for name in HEAD_WIDTH_FIELDS:
        value = getattr(default, name, None)
        if isinstance(value, int) and value > 0 and default_head:
            out[name] = max(2, 2 * round(value * (d // heads) / default_head / 2))
    if getattr(default, "is_decoder", None) is False and has_field(default, "is_decoder"):
        out["is_decoder"] = True  # encoder-decoder families' causal-LM heads (BERT, RoBERTa...) need it
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = getattr(default, name, None)
        if isinstance(value, int) and value >= size.vocab_size:
            out[name] = None  # an id past the recipe's vocabulary (an Embedding's padding_idx would fail)
    return {k: v for k, v in out.items() if has_field(default, k)}


def kv_heads(default: Any, heads: int) -> int:
    """Key/value heads for `heads` query heads, keeping the default's grouping (GQA stays GQA)."""
    q, kv = getattr(default, "num_attention_heads", None), getattr(default, "num_key_value_heads", None)
    if not q or not kv or kv >= q:
        return heads
    want = max(1, round(heads * kv / q))
    return max(g for g in range(1, want + 1) if heads % g == 0)


def scaled(value: int, d: int, width: int) -> int:
    """`value` × d / width, rounded up to a multiple of 8 (at least 8)."""
    return max(8, 8 * math.ceil(value * d / width / 8))


def build_hf(model_type: str, size: GPTConfig, options: dict[str, Any]) -> nn.Module:
    """The causal LM of `model_type` at `size` (random init from the current torch seed)."""
    from transformers import AutoModelForCausalLM

    config = sized_config(model_type, size, options)
    # the recipe's `attention = "eager"`: logits materialised in the autocast dtype, as the reference GPT's
    kernel = {"attn_implementation": "eager"} if size.attention == "eager" else {}
    try:
        model: nn.Module = AutoModelForCausalLM.from_config(config, **kernel)
    except Exception as exc:
        raise ModelSpecError(
            f"hf:{model_type}: transformers could not build it: {' '.join(str(exc).split())}"
        ) from None
    return model
