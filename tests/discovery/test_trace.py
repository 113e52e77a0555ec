"""Discovery by behaviour, role by role, against what each architecture is known to do (its source
code): fused and interleaved q/k rows, GQA, cross-attention, norm placement, final logits, odd
containers — and the traced forward leaves the model and the RNG stream as they were."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from zoo_models import ZOO, ZooModel

import stabkit
from stabkit.discovery import ModelMap

torch.set_num_threads(1)


def traced(name: str) -> tuple[ZooModel, ModelMap]:
    try:
        zoo = ZOO[name]()
    except ImportError as exc:
        pytest.skip(str(exc))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zoo, stabkit.inspect_model(zoo.model, example=(zoo.args, zoo.inputs))


def test_fused_qkv_interleaved_per_head_gpt_neox() -> None:
    _zoo, mm = traced("hf-gpt-neox-sdpa")
    a = mm.blocks[0].attention
    hd, heads = a.head_dim, a.n_heads
    assert a.qkv is not None and a.qkv.endswith("query_key_value") and a.qkv_layout == "traced"
    # modeling_gpt_neox: qkv.view(B, T, H, 3 * hd) -> per head [q | k | v]
    assert a.q_columns == [list(range(3 * hd * h, 3 * hd * h + hd)) for h in range(heads)]
    assert a.k_columns == [list(range(3 * hd * h + hd, 3 * hd * h + 2 * hd)) for h in range(heads)]


def test_fused_qkv_concatenated_gpt2() -> None:
    _zoo, mm = traced("hf-gpt2-sdpa")
    a = mm.blocks[0].attention
    width = a.n_heads * a.head_dim
    assert a.qkv_layout == "q|k|v"
    assert [c for h in a.q_columns for c in h] == list(range(width))
    assert [c for h in a.k_columns for c in h] == list(range(width, 2 * width))


def test_grouped_query_heads_from_the_computation() -> None:
    zoo, mm = traced("hf-llama-sdpa")
    cfg = zoo.model.config
    a = mm.blocks[0].attention
    assert (a.n_heads, a.n_kv_heads) == (cfg.num_attention_heads, cfg.num_key_value_heads)
    assert a.n_kv_heads < a.n_heads and a.layout == "GQA"
    hd = a.head_dim
    assert a.k_columns == [list(range(j * hd, (j + 1) * hd)) for j in range(a.n_kv_heads)]


@pytest.mark.parametrize(
    ("name", "placement", "parallel"),
    [
        ("hf-llama-sdpa", "pre", False),
        ("hf-gemma2-eager", "sandwich", False),
        ("hf-bert-sdpa", "post", False),
        ("hf-bart-sdpa", "post", False),
        ("hf-olmo2-sdpa", "output", False),
        ("hf-cohere-sdpa", "pre", True),
        ("hf-gptj-sdpa", "pre", True),
        ("hf-gpt-neox-sdpa", "pre", True),
        ("hf-t5-sdpa", "pre", False),
        ("torch-encoder-postnorm", "post", False),
        ("torch-encoder-prenorm", "pre", False),
    ],
)
def test_norm_placement_from_the_data_flow(name: str, placement: str, parallel: bool) -> None:
    _zoo, mm = traced(name)
    assert {b.placement for b in mm.blocks} == {placement}
    assert {b.parallel for b in mm.blocks} == {parallel}


@pytest.mark.parametrize("name", ["hf-t5-sdpa", "hf-bart-eager", "torch-transformer"])
def test_cross_attention_sites_in_decoder_blocks(name: str) -> None:
    zoo, mm = traced(name)
    decoder = [b for b in mm.blocks if "decoder" in b.path]
    encoder = [b for b in mm.blocks if "encoder" in b.path]
    assert decoder and encoder
    assert all([a.cross for a in b.attentions] == [False, True] for b in decoder)
    assert all([a.cross for a in b.attentions] == [False] for b in encoder)
    assert len(mm.attention_paths) == zoo.n_attention_calls


@pytest.mark.parametrize(
    ("name", "where"),
    [
        ("hf-llama-sdpa", "lm_head"),
        ("hf-cohere-sdpa", ""),
        ("hf-gemma2-eager", ""),
        ("hand-tied-logit-scale", ""),
    ],
)
def test_final_logits_after_any_scale_or_cap(name: str, where: str) -> None:
    zoo, mm = traced(name)
    assert mm.logits is not None and mm.logits.path == where
    output = zoo.forward()
    module = zoo.model.get_submodule(mm.logits.path)
    seen: list[torch.Tensor] = []
    handle = module.register_forward_hook(lambda m, a, o: seen.append(mm.logits.take(o)))
    output = zoo.forward()
    handle.remove()
    assert torch.equal(seen[-1], zoo.logits_fn(output))


def test_a_bare_encoder_has_no_logits() -> None:
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4))
    mm = stabkit.inspect_model(model)
    assert mm.logits is None and len(mm.blocks) == 2


def test_own_qk_norm_is_recognised() -> None:
    _zoo, mm = traced("hf-olmo2-sdpa")
    assert all(a.qk_norm and a.qk_norm.endswith("q_norm") for a in mm.attentions)


@pytest.mark.parametrize(
    ("name", "blocks", "attention"),
    [
        ("hand-inline", ["h.0", "h.1"], ["h.0", "h.1"]),  # attention inline: the block is the call site
        ("hand-moduledict", ["blocks.layer_0", "blocks.layer_1"], None),
        ("hand-token-mixer", None, ["backbone.0.mixer", "backbone.1.mixer"]),
    ],
)
def test_blocks_and_call_sites_whatever_they_are_called(
    name: str, blocks: list[str] | None, attention: list[str] | None
) -> None:
    _zoo, mm = traced(name)
    if blocks is not None:
        assert mm.block_paths == blocks
    if attention is not None:
        assert mm.attention_paths == attention


def test_nested_stages_give_one_block_per_swin_block() -> None:
    zoo, mm = traced("hf-swin-sdpa")
    assert all(".blocks." in b.path for b in mm.blocks)
    assert len(mm.blocks) == zoo.n_attention_calls


def test_the_traced_forward_leaves_rng_and_buffers_unchanged() -> None:
    class WithBuffers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.drop = nn.Dropout(0.5)
            self.bn = nn.BatchNorm1d(8)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 16)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.drop(self.emb(idx))
            x = self.bn(x.transpose(1, 2)).transpose(1, 2)
            return self.head(x + self.attn(x, x, x, need_weights=False)[0])

    model = WithBuffers()
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    mm = stabkit.inspect_model(model)
    assert torch.equal(torch.rand(4), expected)
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n
    assert mm.attention_paths == ["attn"] and mm.logits is not None and mm.logits.path == "head"
