"""Hugging Face encoder-only masked LMs (BERT family: post-norm; 2 layers: 2 self-attention calls)."""

from __future__ import annotations

from collections.abc import Callable

from ._hf import register
from .base import VOCAB, ZooModel

BUILDERS: dict[str, Callable[[], ZooModel]] = {}

_BERT_LIKE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 32,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}


def _mlm(name: str, config_name: str, model_name: str, notes: str, config: dict, **kw) -> None:
    register(BUILDERS, name, config_name, model_name, "mlm", 2, notes, config, **kw)


_mlm(
    "bert",
    "BertConfig",
    "BertForMaskedLM",
    "post-norm (LayerNorm after each residual add), bidirectional, padding mask, separate q/k/v",
    _BERT_LIKE,
)
_mlm(
    "roberta",
    "RobertaConfig",
    "RobertaForMaskedLM",
    "post-norm, bidirectional, positions offset by padding_idx + 1",
    {**_BERT_LIKE, "max_position_embeddings": 34},
)
_mlm(
    "electra",
    "ElectraConfig",
    "ElectraForMaskedLM",
    "post-norm, embedding size 16 projected to hidden 32 (generator head)",
    {**_BERT_LIKE, "embedding_size": 16},
)
_mlm(
    "distilbert",
    "DistilBertConfig",
    "DistilBertForMaskedLM",
    "post-norm, separate q_lin/k_lin/v_lin, learned positions, no token types",
    {
        "vocab_size": VOCAB,
        "dim": 32,
        "n_layers": 2,
        "n_heads": 4,
        "hidden_dim": 64,
        "max_position_embeddings": 32,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "seq_classif_dropout": 0.0,
    },
)
