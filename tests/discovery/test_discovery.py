"""Discovery finds the roles of every family, takes overrides, and fails clearly without attention."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zoo import EncoderLM, NanoGPT, hf_gpt2, hf_llama, reference_gpt

import stabkit
from stabkit.discovery import DiscoveryError, ModelMap


def test_reference_gpt_map_matches_config() -> None:
    m = reference_gpt(n_kv_heads=2, norm="rmsnorm", norm_placement="sandwich")
    mm = stabkit.inspect_model(m)
    assert mm.family == "stabkit-gpt"
    assert mm.block_paths == ["blocks.0", "blocks.1"]
    a = mm.blocks[1].attention
    assert (a.q, a.k, a.v, a.out) == tuple(
        f"blocks.1.attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")
    )
    assert (a.n_heads, a.n_kv_heads, a.head_dim, a.layout) == (4, 2, 8, "GQA")
    assert mm.blocks[0].placement == "sandwich"
    positions = {n.path: (n.kind, n.sublayer, n.position) for n in mm.blocks[0].norms}
    assert positions == {
        "blocks.0.norm1": ("rmsnorm", "attn", "pre"),
        "blocks.0.norm2": ("rmsnorm", "mlp", "pre"),
        "blocks.0.post_norm1": ("rmsnorm", "attn", "sandwich"),
        "blocks.0.post_norm2": ("rmsnorm", "mlp", "sandwich"),
    }
    assert (mm.final_norm, mm.output_head, mm.vocab_size, mm.d_model) == ("final_norm", "head", 64, 32)
    assert mm.embeddings == ["tok_emb", "pos_emb"]


def test_reference_gpt_post_norm_placement() -> None:
    mm = stabkit.inspect_model(reference_gpt(norm_placement="post"))
    assert {b.placement for b in mm.blocks} == {"post"}
    assert {n.position for n in mm.blocks[0].norms} == {"post"}


def test_nanogpt_fused_qkv() -> None:
    mm = stabkit.inspect_model(NanoGPT(d=48, n_head=6))
    assert mm.family == "nanogpt"
    a = mm.blocks[0].attention
    assert a.qkv == "transformer.h.0.attn.c_attn" and a.q is None and a.qkv_layout == "q|k|v"
    assert (a.n_heads, a.head_dim, a.out) == (6, 8, "transformer.h.0.attn.c_proj")
    assert (mm.final_norm, mm.output_head) == ("transformer.ln_f", "lm_head")


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hf_gpt2(impl: str) -> None:
    mm = stabkit.inspect_model(hf_gpt2(impl))
    assert mm.family == "hf-gpt2"
    assert mm.block_paths == ["transformer.h.0", "transformer.h.1"]
    a = mm.blocks[0].attention
    assert a.qkv == "transformer.h.0.attn.c_attn" and a.impl == impl
    assert (a.n_heads, a.n_kv_heads, a.head_dim) == (4, 4, 8)
    assert mm.blocks[0].placement == "pre"
    assert [n.path for n in mm.blocks[0].norms] == ["transformer.h.0.ln_1", "transformer.h.0.ln_2"]
    assert (mm.final_norm, mm.output_head, mm.vocab_size) == ("transformer.ln_f", "lm_head", 64)


@pytest.mark.parametrize("kv", [4, 2, 1])
def test_hf_llama_kv_layouts(kv: int) -> None:
    mm = stabkit.inspect_model(hf_llama(kv_heads=kv))
    assert mm.family == "hf-llama"
    a = mm.blocks[1].attention
    assert a.q == "model.layers.1.self_attn.q_proj"
    assert (a.n_heads, a.n_kv_heads, a.head_dim) == (4, kv, 8)
    assert a.layout == {4: "MHA", 2: "GQA", 1: "MQA"}[kv]
    assert mm.blocks[1].mlp == "model.layers.1.mlp"
    assert [(n.kind, n.sublayer) for n in mm.blocks[1].norms] == [("rmsnorm", "attn"), ("rmsnorm", "mlp")]
    assert (mm.final_norm, mm.output_head) == ("model.norm", "lm_head")


def test_other_llama_family_members_share_the_layout() -> None:
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    for cfg_cls, model_cls in ((MistralConfig, MistralForCausalLM), (Qwen2Config, Qwen2ForCausalLM)):
        cfg = cfg_cls(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
        )
        mm = stabkit.inspect_model(model_cls(cfg))
        assert mm.family == "hf-llama", cfg_cls.__name__
        assert mm.blocks[0].attention.n_kv_heads == 2


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_encoder(norm_first: bool) -> None:
    mm = stabkit.inspect_model(EncoderLM(norm_first=norm_first))
    assert mm.family == "torch-encoder"
    a = mm.blocks[0].attention
    assert a.path == "encoder.layers.0.self_attn" and a.qkv == "encoder.layers.0.self_attn.in_proj_weight"
    assert a.impl == "torch_mha" and a.out == "encoder.layers.0.self_attn.out_proj"
    assert mm.blocks[0].placement == ("pre" if norm_first else "post")
    assert mm.blocks[0].mlp == "encoder.layers.0.linear2"
    assert (mm.final_norm, mm.output_head) == ("norm", "head")


class OddAttention(nn.Module):
    """Unusual names: to_q / to_k / to_v / to_out, heads in `heads`."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(d, d) for _ in range(4))
        self.n_heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.to_out(self.to_v(x))


class OddLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre_attn_norm = nn.LayerNorm(16)
        self.mixer = OddAttention()
        self.pre_mlp_norm = nn.LayerNorm(16)
        self.ffn = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.pre_attn_norm(x))
        return x + self.ffn(self.pre_mlp_norm(x))


class OddModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.stack = nn.ModuleList(OddLayer() for _ in range(3))
        self.out_norm = nn.LayerNorm(16)
        self.unembed = nn.Linear(16, 50)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for layer in self.stack:
            x = layer(x)
        return self.unembed(self.out_norm(x))


def test_fallback_finds_roles_by_name_and_shape() -> None:
    mm = stabkit.inspect_model(OddModel())
    assert mm.family == "fallback"
    assert mm.block_paths == ["stack.0", "stack.1", "stack.2"]
    a = mm.blocks[2].attention
    assert (a.path, a.q, a.k, a.v, a.out) == (
        "stack.2.mixer",
        "stack.2.mixer.to_q",
        "stack.2.mixer.to_k",
        "stack.2.mixer.to_v",
        "stack.2.mixer.to_out",
    )
    assert (a.n_heads, a.head_dim, a.n_kv_heads) == (2, 8, 2)
    assert mm.blocks[0].mlp == "stack.0.ffn"
    assert [n.sublayer for n in mm.blocks[0].norms] == ["attn", "mlp"]
    assert (mm.final_norm, mm.output_head, mm.vocab_size) == ("out_norm", "unembed", 50)
    assert any("guessed" in n for n in mm.notes)


class Mixer(nn.Module):
    """Attention that no name rule recognises."""

    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wv(x)


class Hidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"mix": Mixer(), "mlp": nn.Linear(8, 8)}) for _ in range(2))
        self.head = nn.Linear(8, 10)


def test_no_attention_error_lists_what_was_found_and_how_to_override() -> None:
    with pytest.raises(DiscoveryError) as err:
        stabkit.inspect_model(Hidden())
    msg = str(err.value)
    assert "no attention found in Hidden" in msg
    assert "Mixer×2" in msg and "layers" in msg and "override=" in msg


def test_user_override_maps_an_unrecognised_model() -> None:
    mm = stabkit.inspect_model(
        Hidden(),
        override={
            "blocks": "layers.*",
            "attention": "mix",
            "n_heads": 2,
            "q": "wq",
            "k": "wk",
            "v": "wv",
            "output_head": "head",
        },
    )
    assert mm.family == "override"
    assert mm.block_paths == ["layers.0", "layers.1"]
    a = mm.blocks[1].attention
    assert (a.path, a.q, a.k, a.n_heads, a.head_dim) == (
        "layers.1.mix",
        "layers.1.mix.wq",
        "layers.1.mix.wk",
        2,
        4,
    )
    assert mm.output_head == "head"


def test_override_errors_are_actionable() -> None:
    with pytest.raises(ValueError, match="unknown override key"):
        stabkit.inspect_model(Hidden(), override={"block": "layers.*"})
    with pytest.raises(DiscoveryError, match="matches no module"):
        stabkit.inspect_model(Hidden(), override={"blocks": "nope.*", "attention": "mix"})


def test_a_complete_modelmap_is_checked_and_returned() -> None:
    model = reference_gpt()
    mm = stabkit.inspect_model(model)
    assert stabkit.inspect_model(model, override=mm) is mm
    bad = ModelMap(family="override", blocks=mm.blocks, output_head="nothing.here")
    with pytest.raises(DiscoveryError, match="nothing.here"):
        stabkit.inspect_model(model, override=bad)


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match="torch.nn.Module"):
        stabkit.inspect_model({"weight": torch.zeros(2)})  # type: ignore[arg-type]


def test_describe_and_to_dict() -> None:
    mm = stabkit.inspect_model(hf_llama(kv_heads=2))
    text = mm.describe()
    assert "GQA" in text and "model.layers.1.self_attn" in text and "output head: lm_head" in text
    d = mm.to_dict()
    assert d["blocks"][0]["attention"]["n_kv_heads"] == 2
