"""Each stand-in's public signature equals the upstream one (issue 38, item 2).

The expected signatures below are copied from the upstream sources the stand-ins follow (read with
``git show``; parameter names, order, kinds and default expressions as written there, annotations left
out). A stand-in that drifts from its library — a parameter renamed, reordered, added or dropped, a
default changed — fails here, so stabkit's readers are never tested against an API that does not exist.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
from standins import installed

FA2 = "Dao-AILab/flash-attention @ 0251105a (2.8.4), flash_attn/flash_attn_interface.py"
FA3 = "Dao-AILab/flash-attention @ 0251105a, hopper/flash_attn_interface.py (flash-attn 3)"
TE = (
    "NVIDIA/TransformerEngine @ d0067d0d (2.20.0.dev0), "
    "transformer_engine/pytorch/attention/dot_product_attention/dot_product_attention.py"
)
TEB = (
    "NVIDIA/TransformerEngine @ d0067d0d (2.20.0.dev0), "
    "transformer_engine/pytorch/attention/dot_product_attention/backends.py"
)
XF = "facebookresearch/xformers @ bed3978b (0.0.35), xformers/ops/fmha/__init__.py"

UPSTREAM: list[tuple[str, str, str]] = [
    (
        "flash_attn.flash_attn_interface:flash_attn_func",
        FA2,
        (
            "q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
            "alibi_slopes=None, deterministic=False, return_attn_probs=False"
        ),
    ),
    (
        "flash_attn.flash_attn_interface:flash_attn_kvpacked_func",
        FA2,
        (
            "q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
            "alibi_slopes=None, deterministic=False, return_attn_probs=False"
        ),
    ),
    (
        "flash_attn.flash_attn_interface:flash_attn_qkvpacked_func",
        FA2,
        (
            "qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
            "alibi_slopes=None, deterministic=False, return_attn_probs=False"
        ),
    ),
    (
        "flash_attn.flash_attn_interface:flash_attn_varlen_func",
        FA2,
        (
            "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, "
            "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, "
            "deterministic=False, return_attn_probs=False, block_table=None"
        ),
    ),
    (
        "flash_attn.flash_attn_interface:flash_attn_varlen_kvpacked_func",
        FA2,
        (
            "q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, "
            "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, "
            "deterministic=False, return_attn_probs=False"
        ),
    ),
    (
        "flash_attn.flash_attn_interface:flash_attn_varlen_qkvpacked_func",
        FA2,
        (
            "qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, "
            "-1), softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False"
        ),
    ),
    (
        "flash_attn_interface:flash_attn_func",
        FA3,
        (
            "q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, "
            "v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, "
            "pack_gqa=None, deterministic=False, sm_margin=0, return_attn_probs=False"
        ),
    ),
    (
        "flash_attn_interface:flash_attn_qkvpacked_func",
        FA3,
        (
            "qkv, softmax_scale=None, causal=False, q_descale=None, k_descale=None, v_descale=None, "
            "window_size=(-1, -1), attention_chunk=0, softcap=0.0, deterministic=False, num_heads_q=None, "
            "sm_margin=0, return_attn_probs=False"
        ),
    ),
    (
        "flash_attn_interface:flash_attn_varlen_func",
        FA3,
        (
            "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,"
            " softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None, "
            "window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, "
            "deterministic=False, sm_margin=0, return_attn_probs=False"
        ),
    ),
    (
        "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention:DotProductAttention.__init__",
        TE,
        (
            "self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0, "
            "qkv_format='sbhd', attn_mask_type='causal', window_size=None, bottom_right_diagonal=None, "
            "sequence_parallel=False, tp_size=1, get_rng_state_tracker=None, tp_group=None, "
            "layer_number=None, attention_type='self', cp_group=None, cp_global_ranks=None, cp_stream=None, "
            "cp_comm_type='p2p', softmax_scale=None, softmax_type='vanilla', return_max_logit=False, "
            "name=None"
        ),
    ),
    (
        "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention:DotProductAttention.forward",
        TE,
        (
            "self, query_layer=None, key_layer=None, value_layer=None, attention_mask=None, qkv_format=None, "
            "cu_seqlens_q=None, cu_seqlens_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, "
            "max_seqlen_q=None, max_seqlen_kv=None, attn_mask_type=None, window_size=None, "
            "bottom_right_diagonal=None, checkpoint_core_attention=False, core_attention_bias_type='no_bias',"
            " core_attention_bias=None, alibi_slopes=None, fast_zero_fill=True, inference_params=None, "
            "pad_between_seqs=None, fp8_output=False, bf16_backward=False, num_splits=1, score_mod=None, "
            "score_mod_bprop=None, score_mod_tensors=None, score_mod_bprop_tensors=None, qkv_layer=None, "
            "kv_layer=None, qkv_interleave_dim=-3"
        ),
    ),
    (
        "xformers.ops.fmha:memory_efficient_attention",
        XF,
        ("query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None, output_dtype=None"),
    ),
    (
        "transformer_engine.pytorch.attention.dot_product_attention.backends:FlashAttention.__init__",
        TEB,
        (
            "self, softmax_scale, attention_dropout=0.0, attention_dropout_ctx=nullcontext, "
            "attention_type='self', layer_number=None, deterministic=False"
        ),
    ),
    (
        "transformer_engine.pytorch.attention.dot_product_attention.backends:FusedAttention.__init__",
        TEB,
        (
            "self, softmax_scale, attention_dropout=0.0, attention_dropout_ctx=nullcontext, "
            "attention_type='self', layer_number=None, deterministic=False, softmax_type='vanilla', "
            "return_max_logit=False"
        ),
    ),
    (
        "transformer_engine.pytorch.attention.dot_product_attention.backends:UnfusedDotProductAttention.__init__",
        TEB,
        (
            "self, softmax_scale, attention_type='self', attention_dropout=0.0, "
            "attention_dropout_ctx=nullcontext, layer_number=None, softmax_type='vanilla', "
            "return_max_logit=False"
        ),
    ),
]
"""(stand-in ``module:qualname``, upstream file it was copied from, upstream parameters)."""


def _default(value: Any) -> str:
    """A default as upstream source writes it: a class or function by name, anything else by repr."""
    return value.__name__ if inspect.isclass(value) or inspect.isfunction(value) else repr(value)


def rendered(fn: Any) -> str:
    """``fn``'s parameters as source text (no annotations): ``q, k, dropout_p=0.0, *, op=None``."""
    parts: list[str] = []
    starred = False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            starred = True
            continue
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not starred:
            parts.append("*")
            starred = True
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.default is inspect.Parameter.empty:
            parts.append(p.name)
        else:
            parts.append(f"{p.name}={_default(p.default)}")
    return ", ".join(parts)


def _resolve(target: str) -> Any:
    module, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "__stabkit_original__", obj)


@pytest.mark.parametrize(("target", "source", "upstream"), UPSTREAM, ids=[t for t, _, _ in UPSTREAM])
def test_stand_in_signature_equals_upstream(target: str, source: str, upstream: str) -> None:
    with installed():
        got = rendered(_resolve(target))
    assert got == upstream, f"{target} drifted from {source}"


def test_rendering_tells_kinds_and_defaults_apart() -> None:
    def f(a, b=(-1, -1), *, c=None, **kw):  # type: ignore[no-untyped-def]
        return None

    def g(a, b=(-1, 0), c=None, **kw):  # type: ignore[no-untyped-def]
        return None

    assert rendered(f) == "a, b=(-1, -1), *, c=None, **kw"
    assert rendered(g) != rendered(f)


FA3_FWD = (  # hopper/flash_api.cpp @ 0251105a, TORCH_LIBRARY(flash_attn_3, m): m.def("fwd(" ...)
    "fwd(Tensor q, Tensor k, Tensor v, Tensor(k_new!)? k_new = None, Tensor(v_new!)? v_new = None, "
    "Tensor? q_v = None, Tensor(out!)? out = None, Tensor? cu_seqlens_q = None, Tensor? cu_seqlens_k = None, "
    "Tensor? cu_seqlens_k_new = None, Tensor? seqused_q = None, Tensor? seqused_k = None, "
    "int? max_seqlen_q = None, int? max_seqlen_k = None, Tensor? page_table = None, "
    "Tensor? kv_batch_idx = None, Tensor? leftpad_k = None, Tensor? rotary_cos = None, "
    "Tensor? rotary_sin = None, Tensor? seqlens_rotary = None, Tensor? q_descale = None, "
    "Tensor? k_descale = None, Tensor? v_descale = None, float? softmax_scale = None, "
    "bool is_causal = False, int window_size_left = -1, int window_size_right = -1, "
    "int attention_chunk = 0, float softcap = 0.0, bool is_rotary_interleaved = False, "
    "Tensor? scheduler_metadata = None, int num_splits = 0, bool? pack_gqa = None, "
    "int sm_margin = 0) -> (Tensor(out!), Tensor, Tensor, Tensor)"
)


def test_flash_attn_3_fwd_op_schema_equals_upstream() -> None:
    import torch

    with installed():
        schema = str(torch.ops.flash_attn_3.fwd.default._schema)
    assert schema == str(torch._C.parse_schema("flash_attn_3::" + FA3_FWD))  # torch's own rendering of both
