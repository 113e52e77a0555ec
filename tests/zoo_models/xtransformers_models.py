"""x-transformers (lucidrains) models: `TransformerWrapper` around `Decoder` / `Encoder` attention layers.

``attn_flash=True`` routes attention through ``F.scaled_dot_product_attention``; without it x-transformers
computes ``einsum(q, k) * scale`` and ``F.softmax`` itself. Each stack of depth 2 holds 2 attention layers
(and 2 feed-forward layers) in one flat ``layers`` ModuleList.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from .base import BATCH, ZooModel, finish, require, token_ce, tokens

BUILDERS: dict[str, Callable[[], ZooModel]] = {}
N_TOKENS = 64
MAX_LEN = 16


def _wrapper(layers_cls: str, flash: bool, **layer_kwargs: Any) -> nn.Module:
    xt = require("x_transformers")
    layers = getattr(xt, layers_cls)(dim=32, depth=2, heads=2, attn_flash=flash, **layer_kwargs)
    return xt.TransformerWrapper(num_tokens=N_TOKENS, max_seq_len=MAX_LEN, attn_layers=layers)


def _lm(layers_cls: str, flash: bool, notes: str, **layer_kwargs: Any) -> ZooModel:
    torch.manual_seed(0)
    model = finish(_wrapper(layers_cls, flash, **layer_kwargs))
    ids = tokens(N_TOKENS)
    ce = token_ce(tokens(N_TOKENS))
    inputs: dict[str, Any] = {}
    if layers_cls == "Encoder":
        inputs["mask"] = torch.ones(ids.shape, dtype=torch.bool)
    return ZooModel(
        model=model,
        inputs=inputs,
        args=(ids,),
        loss_fn=ce,
        logits_fn=lambda out: out,
        n_attention_calls=2,
        notes=f"{notes}; attn={'flash (sdpa)' if flash else 'eager einsum softmax'}",
        n_classes=N_TOKENS,
    )


class _EncoderDecoder(nn.Module):
    """An x-transformers encoder feeding a cross-attending decoder (what `XTransformer` wires up)."""

    def __init__(self, flash: bool) -> None:
        super().__init__()
        xt = require("x_transformers")
        self.encoder = xt.TransformerWrapper(
            num_tokens=N_TOKENS,
            max_seq_len=MAX_LEN,
            attn_layers=xt.Encoder(dim=32, depth=2, heads=2, attn_flash=flash),
        )
        self.decoder = xt.TransformerWrapper(
            num_tokens=N_TOKENS,
            max_seq_len=MAX_LEN,
            attn_layers=xt.Decoder(dim=32, depth=2, heads=2, cross_attend=True, attn_flash=flash),
        )

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        memory = self.encoder(src, return_embeddings=True)
        return self.decoder(tgt, context=memory)


def _encdec(flash: bool) -> ZooModel:
    torch.manual_seed(0)
    model = finish(_EncoderDecoder(flash))
    src, tgt = tokens(N_TOKENS), tokens(N_TOKENS, seq=10)
    ce = token_ce(tokens(N_TOKENS, batch=BATCH, seq=10))
    return ZooModel(
        model=model,
        inputs={},
        args=(src, tgt),
        loss_fn=ce,
        logits_fn=lambda out: out,
        n_attention_calls=6,
        notes="encoder (2 self) + decoder (2 self, 2 cross-attention); "
        f"attn={'flash (sdpa)' if flash else 'eager einsum softmax'}",
        n_classes=N_TOKENS,
    )


for _flash, _suffix in ((True, "flash"), (False, "eager")):
    BUILDERS[f"xt-decoder-{_suffix}"] = partial(
        _lm, "Decoder", _flash, "causal decoder, pre-norm, absolute positions, [attn, ff, attn, ff] layers"
    )
    BUILDERS[f"xt-encoder-{_suffix}"] = partial(_lm, "Encoder", _flash, "bidirectional encoder with key mask")
    BUILDERS[f"xt-decoder-features-{_suffix}"] = partial(
        _lm,
        "Decoder",
        _flash,
        "GQA (1 kv head), rotary, QK-norm (l2, learned scale), sandwich norm, GLU feed-forward",
        rotary_pos_emb=True,
        attn_kv_heads=1,
        attn_qk_norm=True,
        sandwich_norm=True,
        ff_glu=True,
    )
    BUILDERS[f"xt-encdec-{_suffix}"] = partial(_encdec, _flash)
