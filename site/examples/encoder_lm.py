"""A causal language model built from `torch.nn.TransformerEncoder`, as a user's own code would be:
`stabkit run attention-logit-growth --model docs/examples/encoder_lm.py:build` stress-tests it.

`build` takes the keyword arguments stabkit offers that it names (vocab_size, context, d_model,
n_layers, n_heads; stabkit passes the recipe's size) and returns a module whose forward(tokens) gives
the logits (batch, seq, vocab_size).
"""

from __future__ import annotations

import torch
from torch import nn


class EncoderLM(nn.Module):
    """Token + learned position embeddings, a pre-norm causal `nn.TransformerEncoder`, a linear head."""

    def __init__(self, vocab_size: int, context: int, d_model: int, n_layers: int, n_heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Parameter(torch.zeros(context, d_model))
        layer = nn.TransformerEncoderLayer(
            d_model, n_heads, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:seq]
        mask = nn.Transformer.generate_square_subsequent_mask(seq, device=tokens.device)
        h = self.encoder(h, mask=mask, is_causal=True)
        return self.head(self.norm(h))


def build(vocab_size: int, context: int, d_model: int, n_layers: int, n_heads: int) -> EncoderLM:
    """The model at the recipe's size."""
    return EncoderLM(vocab_size, context, d_model, n_layers, n_heads)
