"""Hugging Face vision Transformers (image classification heads, 10 classes)."""

from __future__ import annotations

from collections.abc import Callable

from ._hf import register
from .base import ZooModel

BUILDERS: dict[str, Callable[[], ZooModel]] = {}

_VIT_LIKE = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "image_size": 32,
    "patch_size": 8,
    "num_labels": 10,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}

register(
    BUILDERS,
    "vit",
    "ViTConfig",
    "ViTForImageClassification",
    "image",
    2,
    "patch embedding (8x8 on 32x32: 16 patches + CLS = 17 tokens), pre-norm, bidirectional",
    _VIT_LIKE,
)
register(
    BUILDERS,
    "deit",
    "DeiTConfig",
    "DeiTForImageClassification",
    "image",
    2,
    "ViT with a distillation token (16 patches + CLS + DIST = 18 tokens)",
    _VIT_LIKE,
)
register(
    BUILDERS,
    "dinov2",
    "Dinov2Config",
    "Dinov2ForImageClassification",
    "image",
    2,
    "LayerScale on both residual branches, interpolated position embeddings",
    {**_VIT_LIKE, "mlp_ratio": 2, "drop_path_rate": 0.0},
)
register(
    BUILDERS,
    "swin",
    "SwinConfig",
    "SwinForImageClassification",
    "image",
    3,
    "2 stages (depths 2, 1), windowed attention (window 2, shifted in the 2nd block), relative position "
    "bias (in the softmax input / the SDPA float attn_mask), patch merging; 3 attention calls over "
    "(B * windows, heads, 4, 4)",
    {
        "image_size": 32,
        "patch_size": 4,
        "embed_dim": 16,
        "depths": [2, 1],
        "num_heads": [2, 4],
        "window_size": 2,
        "mlp_ratio": 2.0,
        "num_labels": 10,
        "hidden_dropout_prob": 0.0,
        "attention_probs_dropout_prob": 0.0,
        "drop_path_rate": 0.0,
    },
)
