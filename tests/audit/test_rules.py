"""Each model rule of the audit: a model that triggers it (naming the right paths) and one that does not."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zoo import VOCAB, EncoderLM, NanoGPT, hf_gpt2, hf_llama, reference_gpt

from stabkit.audit import Finding, Report, audit
from stabkit.discovery import inspect_model


def only(report: Report, rule: str) -> Finding:
    found = report.by_rule(rule)
    assert len(found) == 1, f"expected one {rule} finding, got {[f.to_dict() for f in found]}"
    return found[0]


def absent(report: Report, rule: str) -> bool:
    return not report.by_rule(rule)


def tiny_hf(kind: str) -> nn.Module:
    import transformers

    cfg = getattr(transformers, f"{kind}Config")(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=16,
    )  # fmt: skip
    return getattr(transformers, f"{kind}ForCausalLM")(cfg)


# ---------------------------------------------------------------- norms
def test_post_norm_per_block_and_warmup() -> None:
    post = reference_gpt(norm_placement="post")
    r = audit(post)
    f = only(r, "post_norm")
    assert f.where == ["blocks.0", "blocks.1"] and f.severity == "note"
    assert ("norm_placement", {"to": "pre"}) in f.interventions
    assert ("norm_placement", {"to": "sandwich"}) in f.interventions
    w = only(r, "post_norm_no_warmup")
    assert w.severity == "risk" and w.where == ["blocks.0", "blocks.1"]
    assert not absent(audit(post, warmup_steps=0), "post_norm_no_warmup")
    warmed = audit(post, warmup_steps=500)
    assert absent(warmed, "post_norm_no_warmup") and not absent(warmed, "post_norm")
    for placement in ("pre", "sandwich"):
        r2 = audit(reference_gpt(norm_placement=placement))
        assert absent(r2, "post_norm") and absent(r2, "post_norm_no_warmup")


def test_post_norm_on_torch_encoder() -> None:
    assert only(audit(EncoderLM(norm_first=False)), "post_norm").where == [
        "encoder.layers.0",
        "encoder.layers.1",
    ]
    assert absent(audit(EncoderLM(norm_first=True)), "post_norm")


def test_layernorm_bias_lists_every_biased_layernorm_and_reads_values_off_meta() -> None:
    model = reference_gpt(bias=True)
    expected = [n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm) and m.bias is not None]
    f = only(audit(model), "layernorm_bias")
    assert f.where == expected and "blocks.1.norm2" in f.where and "final_norm" in f.where
    assert f.fix == ["rmsnorm"] and f.evidence["nonzero_bias"] == 0  # biases start at zero
    with torch.no_grad():
        model.get_submodule("blocks.1.norm2").bias[3] = 0.5
    assert only(audit(model), "layernorm_bias").evidence["nonzero_bias"] == 1
    assert absent(audit(reference_gpt(bias=False)), "layernorm_bias")
    assert absent(audit(reference_gpt(norm="rmsnorm", bias=True)), "layernorm_bias")


# ---------------------------------------------------------------- the two softmaxes
def test_attention_softmax_unguarded_and_its_guards() -> None:
    f = only(audit(reference_gpt()), "attn_softmax_unguarded")
    assert f.where == ["blocks.0.attn", "blocks.1.attn"] and f.severity == "risk"
    assert [n for n, _ in f.interventions] == ["qk_norm", "attn_softcap"]
    assert absent(audit(reference_gpt(qk_norm=True)), "attn_softmax_unguarded")
    assert absent(audit(reference_gpt(attn_softcap=50.0)), "attn_softmax_unguarded")
    assert absent(audit(reference_gpt(), active_interventions=["attn_softcap"]), "attn_softmax_unguarded")


def test_attention_guard_markers_and_hf_families() -> None:
    model = reference_gpt()
    model.get_submodule("blocks.0.attn")._stabkit_attn_softcap = 50.0  # type: ignore[assignment]
    assert only(audit(model), "attn_softmax_unguarded").where == ["blocks.1.attn"]
    marked = reference_gpt()
    marked.__dict__["_stabkit_interventions"] = {"qk_norm": object()}  # what interventions.apply records
    assert absent(audit(marked), "attn_softmax_unguarded")
    llama = only(audit(hf_llama()), "attn_softmax_unguarded")
    assert llama.where == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert absent(audit(tiny_hf("Qwen3")), "attn_softmax_unguarded")  # q_norm / k_norm submodules
    assert absent(audit(tiny_hf("Gemma2")), "attn_softmax_unguarded")  # attn_logit_softcapping=50


def test_output_softmax_unguarded_and_its_guards() -> None:
    f = only(audit(reference_gpt()), "output_softmax_unguarded")
    assert f.where == ["head"] and [n for n, _ in f.interventions] == ["z_loss", "logit_softcap"]
    assert absent(audit(reference_gpt(logit_softcap=30.0)), "output_softmax_unguarded")
    assert absent(audit(reference_gpt(), active_interventions=["z_loss"]), "output_softmax_unguarded")
    assert only(audit(hf_llama()), "output_softmax_unguarded").where == ["lm_head"]
    assert absent(audit(tiny_hf("Gemma2")), "output_softmax_unguarded")  # final_logit_softcapping=30


# ---------------------------------------------------------------- shapes
def test_head_dim_small() -> None:
    f = only(audit(reference_gpt()), "head_dim_small")  # d 32 / 4 heads = 8
    assert f.where == ["blocks.0.attn", "blocks.1.attn"] and f.evidence["head_dim"] == 8
    assert only(audit(hf_llama()), "head_dim_small").where[0] == "model.layers.0.self_attn"
    assert absent(audit(reference_gpt(d_model=64, n_heads=2)), "head_dim_small")  # head_dim 32


def test_heads_not_dividing() -> None:
    f = only(audit(NanoGPT(d=30, n_head=4)), "heads_not_dividing")
    assert f.where == ["transformer.h.0.attn", "transformer.h.1.attn"] and f.evidence["d_model"] == 30
    assert absent(audit(NanoGPT()), "heads_not_dividing")
    model = reference_gpt()  # 4 heads; a map that says 3 kv heads does not divide them
    mmap = inspect_model(model, override={"n_kv_heads": 3, "blocks": "blocks.*"})
    assert only(audit(model, model_map=mmap), "heads_not_dividing").evidence["n_kv_heads"] == 3


def test_ffn_ratio_plain_and_gated() -> None:
    f = only(audit(reference_gpt(d_ff=32)), "ffn_ratio")  # ratio 1 against 4
    assert f.where == ["blocks.0.mlp", "blocks.1.mlp"]
    assert (f.evidence["d_ff"], f.evidence["ratio"], f.evidence["gated"]) == (32, 1.0, False)
    g = only(audit(reference_gpt(mlp="swiglu", d_ff=256)), "ffn_ratio")  # ratio 8 against 8/3
    assert g.evidence["gated"] is True and g.fix == ["d_ff≈8/3·d_model"]
    for ok in (reference_gpt(), reference_gpt(mlp="swiglu"), hf_llama(), hf_gpt2(), NanoGPT()):
        assert absent(audit(ok), "ffn_ratio")


# ---------------------------------------------------------------- biases and dropout
def test_linear_bias_names_each_biased_linear() -> None:
    model = reference_gpt(bias=True)
    expected = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.bias is not None]
    f = only(audit(model), "linear_bias")
    assert f.where == expected and "blocks.0.attn.q_proj" in f.where
    assert f.evidence["bias_parameters"] == sum(model.get_submodule(p).bias.numel() for p in expected)
    assert absent(audit(reference_gpt()), "linear_bias")
    assert "transformer.h.0.attn.c_attn" in only(audit(hf_gpt2()), "linear_bias").where  # HF Conv1D
    enc = only(audit(EncoderLM()), "linear_bias").where
    assert "encoder.layers.0.self_attn.in_proj_bias" in enc and "head" in enc


def test_dropout_modules_rates_and_config() -> None:
    f = only(audit(reference_gpt(dropout=0.1)), "dropout")
    assert {"drop", "blocks.0.drop", "blocks.1.attn.dropout", "config.dropout"} <= set(f.where)
    assert f.evidence["max_rate"] == pytest.approx(0.1)
    assert absent(audit(reference_gpt()), "dropout")
    assert absent(audit(hf_gpt2()), "dropout")  # the zoo sets every pdrop to 0
    gpt2 = hf_gpt2()
    gpt2.config.attn_pdrop = 0.2
    gpt2.transformer.h[1].attn.attn_dropout.p = 0.2
    where = only(audit(gpt2), "dropout").where
    assert where == ["transformer.h.1.attn.attn_dropout", "config.attn_pdrop"]


def test_recommended_model_has_no_model_findings() -> None:
    """A model built the way the sources recommend: pre-RMSNorm, QK-norm, final cap, no bias, head_dim 32."""
    model = reference_gpt(d_model=64, n_heads=2, norm="rmsnorm", qk_norm=True, logit_softcap=30.0)
    assert audit(model).findings == []


@pytest.mark.parametrize(
    ("name", "options", "rule"),
    [
        ("qk_norm", {}, "attn_softmax_unguarded"),
        ("attn_softcap", {}, "attn_softmax_unguarded"),
        ("logit_softcap", {}, "output_softmax_unguarded"),
        ("z_loss", {}, "output_softmax_unguarded"),
        ("rmsnorm", {}, "layernorm_bias"),
        ("norm_placement", {"to": "pre"}, "post_norm"),
    ],
)
def test_the_suggested_intervention_clears_its_finding(name: str, options: dict, rule: str) -> None:
    interventions = pytest.importorskip("stabkit.interventions")
    model = reference_gpt(bias=True, norm_placement="post")
    assert any(name == n for f in audit(model).by_rule(rule) for n, _ in f.interventions)
    handle = interventions.apply(model, name, **options)
    assert absent(audit(model), rule)
    handle.remove()
    assert not absent(audit(model), rule)
