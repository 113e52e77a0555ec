"""``torch.nn`` Transformer modules (attention through ``F.multi_head_attention_forward``), wrapped with an
embedding and an output Linear so they have token logits."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from .base import SEQ, VOCAB, ZooModel, finish, token_ce, tokens

BUILDERS: dict[str, Callable[[], ZooModel]] = {}
D_MODEL, HEADS, FF = 32, 2, 64
TGT_LEN = 10


def _zoo(model: nn.Module, args: tuple, n_calls: int, notes: str, target_len: int = SEQ) -> ZooModel:
    ce = token_ce(tokens(seq=target_len))
    return ZooModel(
        model=finish(model),
        inputs={},
        args=args,
        loss_fn=ce,
        logits_fn=lambda out: out,
        n_attention_calls=n_calls,
        notes=notes,
        n_classes=VOCAB,
    )


class Seq2Seq(nn.Module):
    """nn.Transformer (2 + 2 layers) between token embeddings and a vocabulary Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.src_emb = nn.Embedding(VOCAB, D_MODEL)
        self.tgt_emb = nn.Embedding(VOCAB, D_MODEL)
        self.transformer = nn.Transformer(
            d_model=D_MODEL,
            nhead=HEADS,
            num_encoder_layers=2,
            num_decoder_layers=2,
            dim_feedforward=FF,
            dropout=0.0,
            batch_first=True,
        )
        self.out = nn.Linear(D_MODEL, VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        tgt_mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        h = self.transformer(self.src_emb(src), self.tgt_emb(tgt), tgt_mask=tgt_mask, tgt_is_causal=True)
        return self.out(h)


class DecoderOnly(nn.Module):
    """nn.TransformerDecoder (2 layers) reading a fixed memory: self-attention + cross-attention per layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D_MODEL)
        layer = nn.TransformerDecoderLayer(D_MODEL, HEADS, FF, dropout=0.0, batch_first=True, norm_first=True)
        self.decoder = nn.TransformerDecoder(layer, num_layers=2, norm=nn.LayerNorm(D_MODEL))
        self.out = nn.Linear(D_MODEL, VOCAB)

    def forward(self, tgt: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.out(self.decoder(self.emb(tgt), memory, tgt_mask=mask, tgt_is_causal=True))


class EncoderOnly(nn.Module):
    """nn.TransformerEncoder (2 layers) with a key padding mask, post-norm or pre-norm."""

    def __init__(self, norm_first: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Parameter(torch.randn(SEQ, D_MODEL) * 0.02)
        layer = nn.TransformerEncoderLayer(
            D_MODEL, HEADS, FF, dropout=0.0, batch_first=True, norm_first=norm_first
        )
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.out = nn.Linear(D_MODEL, VOCAB)

    def forward(self, ids: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return self.out(self.encoder(self.emb(ids) + self.pos, src_key_padding_mask=padding))


def _seq2seq() -> ZooModel:
    torch.manual_seed(0)
    model = Seq2Seq()
    args = (tokens(), tokens(seq=TGT_LEN))
    return _zoo(
        model,
        args,
        6,
        "nn.Transformer: post-norm, 2 encoder self + 2 decoder self (float causal mask) + 2 cross-attention",
        target_len=TGT_LEN,
    )


def _decoder() -> ZooModel:
    torch.manual_seed(0)
    model = DecoderOnly()
    args = (tokens(seq=TGT_LEN), torch.randn(2, SEQ, D_MODEL))
    return _zoo(
        model,
        args,
        4,
        "nn.TransformerDecoder with memory: pre-norm, 2 self (causal) + 2 cross-attention",
        target_len=TGT_LEN,
    )


def _encoder(norm_first: bool) -> ZooModel:
    torch.manual_seed(0)
    model = EncoderOnly(norm_first)
    padding = torch.zeros(2, SEQ, dtype=torch.bool)
    padding[1, -3:] = True  # the second sequence ends in 3 padding tokens
    return _zoo(
        model,
        (tokens(), padding),
        2,
        f"nn.TransformerEncoder: {'pre-norm' if norm_first else 'post-norm'}, key padding mask",
    )


BUILDERS["torch-transformer"] = _seq2seq
BUILDERS["torch-decoder"] = _decoder
BUILDERS["torch-encoder-prenorm"] = partial(_encoder, True)
BUILDERS["torch-encoder-postnorm"] = partial(_encoder, False)
