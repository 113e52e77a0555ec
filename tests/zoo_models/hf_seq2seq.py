"""Hugging Face encoder-decoder models (2 + 2 layers: 2 encoder self, 2 decoder self, 2 cross = 6 calls)."""

from __future__ import annotations

from collections.abc import Callable

from ._hf import register
from .base import VOCAB, ZooModel

BUILDERS: dict[str, Callable[[], ZooModel]] = {}

_BART_LIKE = {
    "vocab_size": VOCAB,
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 64,
    "decoder_ffn_dim": 64,
    "max_position_embeddings": 32,
    "dropout": 0.0,
    "attention_dropout": 0.0,
    "activation_dropout": 0.0,
    "encoder_layerdrop": 0.0,
    "decoder_layerdrop": 0.0,
    "use_cache": False,
}


def _s2s(name: str, config_name: str, model_name: str, notes: str, config: dict, **kw) -> None:
    register(BUILDERS, name, config_name, model_name, "seq2seq", 6, notes, config, **kw)


_s2s(
    "t5",
    "T5Config",
    "T5ForConditionalGeneration",
    "cross-attention, relative position bias (added to unscaled logits; reaches SDPA as a float attn_mask), "
    "RMSNorm pre-norm, no 1/sqrt(d)",
    {
        "vocab_size": VOCAB,
        "d_model": 32,
        "d_kv": 8,
        "d_ff": 64,
        "num_layers": 2,
        "num_decoder_layers": 2,
        "num_heads": 4,
        "relative_attention_num_buckets": 8,
        "relative_attention_max_distance": 16,
        "dropout_rate": 0.0,
        "use_cache": False,
    },
)
_s2s(
    "bart",
    "BartConfig",
    "BartForConditionalGeneration",
    "cross-attention, post-norm, learned positions (offset 2), embedding LayerNorm",
    _BART_LIKE,
)
_s2s(
    "mbart",
    "MBartConfig",
    "MBartForConditionalGeneration",
    "cross-attention, pre-norm with final encoder/decoder LayerNorms",
    _BART_LIKE,
)
