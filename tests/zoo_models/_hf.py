"""Shared plumbing of the Hugging Face builders: tiny configs -> ZooModel, one entry per attention backend."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from .base import BATCH, SEQ, VOCAB, ZooModel, finish, require, token_ce, tokens

IMPLEMENTATIONS = ("sdpa", "eager")


def build(
    config_name: str,
    model_name: str,
    impl: str,
    kind: str,
    n_calls: int,
    notes: str,
    config: dict[str, Any],
) -> ZooModel:
    """Build ``transformers.<model_name>(transformers.<config_name>(**config))`` with `impl` attention.

    `kind`: "causal" (input_ids -> (B, L, V) logits), "mlm" (input_ids + attention_mask),
    "seq2seq" (input_ids + decoder_input_ids -> (B, Ld, V)), "image" (pixel_values -> (B, C)).
    """
    transformers = require("transformers")
    torch.manual_seed(0)
    if kind != "image":  # special token ids inside the tiny vocabulary (the defaults point past it)
        config = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, **config}
        if kind == "seq2seq":
            config = {"decoder_start_token_id": 2, **config}
    cfg = getattr(transformers, config_name)(**config, attn_implementation=impl)
    model = finish(getattr(transformers, model_name)(cfg))
    got = model.config._attn_implementation
    if got != impl:
        raise AssertionError(f"{model_name}: asked for {impl!r} attention, got {got!r}")
    inputs: dict[str, Any]
    if kind == "image":
        n_classes = cfg.num_labels
        size = config.get("image_size", 32)
        inputs = {"pixel_values": torch.randn(BATCH, config.get("num_channels", 3), size, size)}
        targets = torch.randint(0, n_classes, (BATCH,))
    else:
        n_classes = cfg.vocab_size
        inputs = {"input_ids": tokens(n_classes)}
        targets = tokens(n_classes)
        if kind == "mlm":
            inputs["attention_mask"] = torch.ones(BATCH, SEQ, dtype=torch.long)
        elif kind == "seq2seq":
            inputs["decoder_input_ids"] = tokens(n_classes, seq=SEQ - 2)
            targets = tokens(n_classes, seq=SEQ - 2)
        elif kind != "causal":
            raise ValueError(kind)
    if kind in ("causal", "seq2seq"):
        inputs["use_cache"] = False
    inputs["return_dict"] = True
    ce = token_ce(targets)
    return ZooModel(
        model=model,
        inputs=inputs,
        loss_fn=lambda out: ce(out.logits),
        logits_fn=lambda out: out.logits,
        n_attention_calls=n_calls,
        notes=notes,
        n_classes=n_classes,
    )


def register(
    registry: dict[str, Callable[[], ZooModel]],
    name: str,
    config_name: str,
    model_name: str,
    kind: str,
    n_calls: int,
    notes: str,
    config: dict[str, Any],
    impls: tuple[str, ...] = IMPLEMENTATIONS,
) -> None:
    """Add ``hf-<name>-<impl>`` entries to `registry`, one per attention implementation in `impls`."""
    for impl in impls:
        registry[f"hf-{name}-{impl}"] = partial(
            build, config_name, model_name, impl, kind, n_calls, f"{notes}; attn={impl}", config
        )


# Sizes shared by the decoder configs that use the common Llama-style names.
LLAMA_LIKE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32,
    "attention_dropout": 0.0,
    "use_cache": False,
}
