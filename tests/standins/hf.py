"""Run Hugging Face's OWN flash-attention-2 code path on CPU, on top of the flash-attn stand-in.

``attn_implementation="flash_attention_2"`` cannot be used on a CPU machine: transformers' availability
check (``is_flash_attn_2_available``) requires CUDA and a ``flash-attn`` distribution, and without them
``_lazy_imports`` falls back to downloading a hub kernel. So the helper registers the stand-in under its
own name (default ``"flash_standin"``; it contains "flash", so ``is_flash_attention_requested`` is True and
models take their flash-specific branches):

- ``AttentionInterface.register(name, f)`` where ``f`` calls transformers'
  ``integrations.flash_attention.flash_attention_forward`` unchanged -> ``_flash_attention_forward`` ->
  ``flash_attn_func`` (plain batch), or ``flash_attn_varlen_func`` (padding mask -> unpad, or packed
  sequences: batch 1 with position_ids restarting at 0, or explicit cu_seq_lens_q/k) of the stand-in;
- ``AttentionMaskInterface.register(name, masking_utils.flash_attention_mask)`` (2-D padding mask or None,
  as for "flash_attention_2");
- transformers' lazy flash loader (``modeling_flash_attention_utils.lazy_import_flash_attention``) caches
  the functions it loaded in module globals keyed by implementation name; ``f`` fills that cache for
  ``name`` with the stand-in's ``flash_attn_func``, ``flash_attn_varlen_func``, ``flash_attn_with_kvcache``
  and ``flash_attn.bert_padding.pad_input`` / ``unpad_input`` (exactly what ``_lazy_imports`` imports for
  "flash_attention_2") before every call. This touches private globals of transformers (checked with
  transformers 5.24); it is the one non-public step.

``hf_model_with_flash_standin`` installs the stand-ins (``tests.standins.install()``) and leaves them installed;
wrap it in ``tests.standins.installed()`` to have them removed again. Models built this way keep working after
an uninstall (transformers holds the stand-in functions).

Also checked (transformers 5.24, torch 2.13 CPU): ``attn_implementation="flex_attention"`` runs transformers' own
flex path on CPU for forward passes without gradients only — it always goes through ``torch.compile`` (about 40 s
for the first call of a 2-layer model here) and torch raises "FlexAttention does not support backward on CPU" for
any input that requires grad, so no helper is provided for it.
"""

from __future__ import annotations

import functools
from typing import Any

from . import install

DEFAULT_NAME = "flash_standin"


@functools.cache
def _loaded_functions() -> tuple[Any, ...]:
    install()
    from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from flash_attn.bert_padding import pad_input, unpad_input
    from transformers import modeling_flash_attention_utils as mfau

    fns = (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, pad_input, unpad_input)
    process = (
        mfau._lazy_define_process_function(flash_attn_varlen_func),
        mfau._lazy_define_process_function(flash_attn_with_kvcache),
    )
    return fns, process


def _seed_transformers_flash_cache(name: str) -> None:
    from transformers import modeling_flash_attention_utils as mfau

    if mfau._loaded_implementation == name:
        return
    fns, process = _loaded_functions()
    mfau._flash_fn, mfau._flash_varlen_fn, mfau._flash_with_kvcache_fn, mfau._pad_fn, mfau._unpad_fn = fns
    mfau._process_flash_kwargs_fn, mfau._process_with_kvcache_kwargs_fn = process
    mfau._loaded_implementation = name


@functools.cache
def register_flash_standin(name: str = DEFAULT_NAME) -> str:
    """Install the stand-ins and register ``name`` as a transformers attention implementation. Idempotent."""
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    _loaded_functions()

    def flash_standin_attention_forward(module, query, key, value, attention_mask, **kwargs):
        _seed_transformers_flash_cache(name)
        return flash_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(name, flash_standin_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)
    _seed_transformers_flash_cache(name)
    return name


def hf_model_with_flash_standin(config_cls, model_cls, *, attn_name: str = DEFAULT_NAME, **config):
    """A freshly initialised ``model_cls(config_cls(**config))`` running transformers' flash-attention-2 path.

    Example: ``hf_model_with_flash_standin(LlamaConfig, LlamaForCausalLM, hidden_size=32, intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=96)``. Nothing is downloaded.
    """
    install()
    name = register_flash_standin(attn_name)
    cfg = config_cls(**config)
    cfg._attn_implementation = name
    _seed_transformers_flash_cache(name)
    return model_cls(cfg)
