"""What discovery and the probes get right on recent architectures (tiny Hugging Face models from the
zoo): MoE layers as the MLP, MLA and sink attention measured, hybrids' layers without attention as
blocks, contrastive models' similarity logits; and the interventions' routes for q/k that no projection
module outputs (an einsum with a weight; nn.TransformerDecoder's cross-attention)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zoo_models import ZOO, ZooModel

import stabkit
from stabkit.interventions import InterventionError, apply

torch.set_num_threads(1)


def build(name: str) -> ZooModel:
    try:
        return ZOO[name]()
    except ImportError as exc:
        pytest.skip(str(exc))


def mapped(name: str) -> tuple[ZooModel, stabkit.ModelMap]:
    zoo = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zoo, stabkit.inspect_model(zoo.model, example=(zoo.args, zoo.inputs))


def test_moe_layers_are_the_mlp_not_a_shared_expert() -> None:
    _, mm = mapped("hf-deepseek-v3-sdpa")
    assert [b.mlp for b in mm.blocks] == ["model.layers.0.mlp", "model.layers.1.mlp"]  # dense, then MoE
    _, mm = mapped("hf-qwen3-moe-sdpa")
    assert [b.mlp for b in mm.blocks] == ["model.layers.0.mlp", "model.layers.1.mlp"]


def test_hybrid_layers_without_attention_are_blocks_with_their_mixer_and_norms() -> None:
    _, mm = mapped("hf-jamba-sdpa")
    mamba, attention = mm.blocks
    assert (mamba.path, mamba.attention, mamba.mixer) == ("model.layers.0", None, "model.layers.0.mamba")
    assert mamba.placement == "pre" and mamba.mlp == "model.layers.0.feed_forward"
    assert attention.attention is not None and mm.attention_paths == ["model.layers.1.self_attn"]
    _, mm = mapped("hf-bamba-sdpa")  # the same layer class for both kinds
    assert [b.mixer for b in mm.blocks] == ["model.layers.0.mamba", None]


def test_contrastive_logits_are_the_similarity_logits() -> None:
    zoo, mm = mapped("hf-clip-sdpa")
    assert mm.logits is not None and mm.logits.key == "logits_per_image"
    cfg = stabkit.MonitorConfig(console=False, log_every=1, audit=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon = stabkit.attach(zoo.model, config=cfg)
    out = zoo.forward()
    zoo.loss_fn(out).backward()
    mon.step()
    mon.detach()
    lse = torch.logsumexp(out.logits_per_image.detach(), dim=-1)
    assert mon.metrics["logits/logz_mean"] == pytest.approx(float(lse.mean()), rel=1e-5)


def test_gpt_oss_sinks_give_the_true_max_logit_and_the_sink_mass() -> None:
    zoo, mm = mapped("hf-gpt-oss-eager")
    assert [(a.softmax_shift, a.sink_columns) for a in mm.attentions] == [(True, 1), (True, 1)]
    weights: list[torch.Tensor] = []
    hooks = [
        zoo.model.get_submodule(p).register_forward_hook(lambda m, a, o: weights.append(o[1].detach()))
        for p in mm.attention_paths
    ]
    cfg = stabkit.MonitorConfig.full(
        attn_sample_rows=None, attn_sample_queries=None, console=False, audit=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon = stabkit.attach(zoo.model, config=cfg)
    weights.clear()
    zoo.loss_fn(zoo.forward()).backward()
    mon.step()
    mon.detach()
    for h in hooks:
        h.remove()
    for path, w in zip(mm.attention_paths, weights, strict=True):  # w: (B, H, L, S) without the sink column
        rows = w.sum(-1) > 0  # rows with an allowed key
        sink = (1 - w.double().sum(-1))[rows].mean()  # what the dropped sink column held
        assert mon.metrics[f"attn/{path}/sink_mass"] == pytest.approx(float(sink), rel=1e-4, abs=1e-6)


class EinsumAttention(nn.Module):
    """q, k, v, o as einsums with weight parameters: no Linear to hook."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.w_q, self.w_k, self.w_v, self.w_o = (nn.Parameter(torch.randn(d, d) * 0.2) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def heads(w: torch.Tensor) -> torch.Tensor:
            return torch.einsum("btd,de->bte", x, w).view(b, t, self.heads, -1).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.w_q), heads(self.w_k), heads(self.w_v), is_causal=True)
        return torch.einsum("bte,ed->btd", y.transpose(1, 2).reshape(b, t, d), self.w_o)


class EinsumLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"ln": nn.LayerNorm(32), "attn": EinsumAttention()}) for _ in range(2)
        )
        self.head = nn.Linear(32, 50)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = x + layer["attn"](layer["ln"](x))
        return self.head(x)


class Capture(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.qk: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        if func is F.scaled_dot_product_attention:
            self.qk.append((args[0].detach(), args[1].detach()))
        return func(*args, **(kwargs or {}))


def _normalised(qk: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    return all(
        torch.allclose(x.pow(2).mean(-1).sqrt(), torch.ones(()), atol=1e-2) for pair in qk for x in pair
    )


def test_qk_norm_through_an_einsum_with_a_weight() -> None:
    torch.manual_seed(0)
    model = EinsumLM()
    idx = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        before = model(idx)
    mm = stabkit.inspect_model(model)
    a = mm.attentions[0]
    assert (a.q, a.q_weight, a.k_weight) == (None, "layers.0.attn.w_q", "layers.0.attn.w_k")
    handle = apply(model, "qk_norm")  # verified in effect
    capture = Capture()
    with torch.no_grad(), capture:
        model(idx)
    assert len(capture.qk) == 2 and _normalised(capture.qk)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(idx), before)


class DecoderLM(nn.Module):
    """nn.TransformerDecoder over its own memory: self- and cross-attention; a forward of two inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        layer = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoder(layer, 2)
        self.head = nn.Linear(32, 50)

    def forward(self, idx: torch.Tensor, memory_idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder(self.emb(idx), self.emb(memory_idx)))


def test_qk_norm_on_a_decoder_needs_a_trace_and_then_covers_the_cross_attention() -> None:
    torch.manual_seed(0)
    model = DecoderLM()
    example = (torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (2, 5)))
    with pytest.raises(InterventionError, match="pass example="):
        apply(model, "qk_norm")  # stabkit cannot make two inputs: names alone would miss calls
    handle = apply(model, "qk_norm", example=example)
    capture = Capture()
    with torch.no_grad(), capture:
        model(*example)
    assert len(capture.qk) == 4 and _normalised(capture.qk)  # 2 self + 2 cross calls
    handle.remove()
