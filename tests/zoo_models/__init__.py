"""A zoo of tiny third-party and hand-written Transformers for tests.

``ZOO`` maps an entry name to a builder: ``ZOO["hf-llama-sdpa"]()`` returns a `ZooModel` (a seeded, tiny,
float32 CPU model in train mode with inputs, a loss and a logits accessor) in well under a second.
Builders import their third-party package when called, so a missing package only makes its entries
raise ImportError (tests turn that into a skip). Entry names start with their source:

- ``hf-<arch>-<sdpa|eager>``: Hugging Face transformers (`hf_decoders`, `hf_encoders`, `hf_seq2seq`,
  `hf_vision`, and `hf_modern`: MLA, attention sinks, sliding / chunked windows, NoPE, MoE, hybrids with
  Mamba / convolution / linear-attention layers, Whisper, CLIP / SigLIP), one entry per attention
  implementation the architecture supports;
- ``timm-*``: timm ViT / Swin, fused (SDPA) and non-fused attention;
- ``xt-*``: x-transformers, flash (SDPA) and eager attention;
- ``litgpt-*``: litgpt (not installed by the zoo: its huggingface-hub pin conflicts with transformers);
- ``torch-*``: ``nn.Transformer`` / ``nn.TransformerDecoder`` / ``nn.TransformerEncoder``;
- ``hand-*``: hand-written GPTs with attention in awkward places (`handwritten`).

`reference.attention_logit_maxima` is an independent per-call reference of the attention logit maxima.
"""

from __future__ import annotations

from collections.abc import Callable

from . import (
    handwritten,
    hf_decoders,
    hf_encoders,
    hf_modern,
    hf_seq2seq,
    hf_vision,
    litgpt_models,
    timm_models,
    torch_models,
    xtransformers_models,
)
from .base import ZooModel
from .reference import attention_logit_maxima

__all__ = ["ZOO", "ZooModel", "attention_logit_maxima"]

ZOO: dict[str, Callable[[], ZooModel]] = {}
for _module in (
    hf_decoders,
    hf_encoders,
    hf_seq2seq,
    hf_vision,
    hf_modern,
    timm_models,
    xtransformers_models,
    litgpt_models,
    torch_models,
    handwritten,
):
    for _name, _builder in _module.BUILDERS.items():
        if _name in ZOO:
            raise RuntimeError(f"zoo entry {_name!r} registered twice")
        ZOO[_name] = _builder
