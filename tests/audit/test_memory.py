"""Memory summary: KV cache against the hand formula (MHA, GQA, MQA), parameters by kind and dtype."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from zoo import VOCAB, EncoderLM, hf_llama, reference_gpt

from stabkit.audit import audit


@pytest.mark.parametrize(("kv_heads", "layout"), [(4, "MHA"), (2, "GQA"), (1, "MQA")])
def test_kv_cache_matches_hand_formula_for_hf_llama(kv_heads: int, layout: str) -> None:
    model = hf_llama(kv_heads=kv_heads)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4  # fp32
    mha = 2 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * 4
    kv = audit(model, seq_len=100).memory.kv_cache
    assert kv is not None and kv.layout == layout
    assert kv.bytes_per_token == per_token and kv.bytes_at_seq_len == 100 * per_token
    assert kv.mha_bytes_per_token == mha and kv.saving == pytest.approx(cfg.num_attention_heads / kv_heads)
    bf16 = audit(model, seq_len=100, kv_dtype=torch.bfloat16).memory.kv_cache
    assert bf16 is not None and bf16.bytes_per_token == per_token // 2


def test_kv_dtype_follows_the_key_projection_and_context_default() -> None:
    model = reference_gpt(n_kv_heads=2).to(torch.bfloat16)
    mem = audit(model).memory
    kv = mem.kv_cache
    assert kv is not None and kv.dtype == "bfloat16" and kv.bytes_per_element == 2
    assert kv.seq_len == 16 and kv.bytes_at_seq_len == 16 * 2 * 2 * 2 * 8 * 2  # context 16 from the config
    assert any("seq_len not given" in n for n in mem.notes)
    text = audit(model).to_text()
    assert "GQA saves 2.0×" in text


def test_parameters_by_kind_sum_to_the_model() -> None:
    model = reference_gpt()
    d, layers, ctx = 32, 2, 16
    mem = audit(model).memory
    counts = {k: v["count"] for k, v in mem.params.items()}
    norms = sum(p.numel() for m in model.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters())
    assert counts == {
        "embedding": VOCAB * d + ctx * d,
        "attention": layers * 4 * d * d,
        "mlp": layers * 2 * d * 4 * d,
        "norm": norms,
        "head": VOCAB * d,
        "other": 0,
    }
    assert mem.total_params == sum(p.numel() for p in model.parameters())
    assert mem.params["mlp"]["bytes"] == {"float32": 4 * counts["mlp"]}


def test_tied_head_counted_once_and_encoder_in_proj_is_attention() -> None:
    tied = audit(reference_gpt(tie_embeddings=True)).memory
    assert tied.params["head"]["count"] == 0 and any("tied" in n for n in tied.notes)
    assert tied.total_params == sum(p.numel() for p in reference_gpt(tie_embeddings=True).parameters())
    enc = EncoderLM()
    attn = sum(p.numel() for layer in enc.encoder.layers for p in layer.self_attn.parameters())
    assert audit(enc).memory.params["attention"]["count"] == attn


def test_memory_on_meta_device_reads_only_shapes() -> None:
    with torch.device("meta"):
        model = reference_gpt(n_kv_heads=1, bias=True, dropout=0.1, norm_placement="post")
    opt = torch.optim.AdamW(model.parameters(), eps=1e-5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = audit(model, opt, seq_len=8)
    assert not [w for w in caught if "stabkit audit rule" in str(w.message)]  # no rule read a value
    assert {f.rule for f in report.findings} >= {"post_norm", "linear_bias", "dropout", "adam_eps"}
    assert report.inputs["meta_device"] is True
    assert report.memory.total_params == sum(p.numel() for p in model.parameters())
    assert report.by_rule("layernorm_bias")[0].evidence["nonzero_bias"] == "unknown (meta device)"
    assert report.memory.kv_cache.layout == "MQA"
