"""The attention probe in training: observation only, sampling bounds, narrow scope, micro-batches, failures."""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
import zoo
from torch import nn

import stabkit
from stabkit import MonitorConfig
from stabkit.harness.data import load_corpus
from stabkit.harness.models import GPT, preset_config
from stabkit.probes.base import ProbeError

EXACT = dict(attn_sample_rows=None, attn_sample_queries=None)


def config(**kw: object) -> MonitorConfig:
    base: dict[str, object] = dict(every=1, console=False, families=frozenset({"attn", "loss"}))
    base.update(kw)
    return MonitorConfig(**base)  # type: ignore[arg-type]


def train_losses(
    build: Callable[[], nn.Module], cfg: MonitorConfig | None, steps: int = 10, extra_draw: bool = False
) -> torch.Tensor:
    torch.manual_seed(0)
    model = build()
    if extra_draw:
        torch.rand(1)  # one extra use of the global RNG
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mon = stabkit.attach(model, opt, config=cfg, logdir=None) if cfg is not None else None
    losses = []
    for step in range(steps):
        idx, tgt = zoo.batch(step)
        loss = zoo.lm_loss(zoo.forward_logits(model, idx), tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if mon is not None:
            mon.step(loss)
        losses.append(loss.detach())
    if mon is not None:
        mon.flush()
        assert any(k.startswith("attn/") for k in mon.metrics)  # the probe did measure
        mon.detach()
    return torch.stack(losses)


def llama_with_attention_dropout() -> nn.Module:
    model = zoo.hf_llama("eager", kv_heads=2)
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    return model


def encoder_with_attention_dropout() -> nn.Module:
    model = zoo.EncoderLM()
    for layer in model.encoder.layers:
        layer.self_attn.dropout = 0.1
    return model


def reference_with_dropout() -> nn.Module:
    return zoo.reference_gpt(dropout=0.1, positions="rope", n_kv_heads=2)


BUILDS = [reference_with_dropout, llama_with_attention_dropout, encoder_with_attention_dropout]


@pytest.mark.parametrize("build", BUILDS, ids=["reference-sdpa", "hf_llama-eager", "encoder-mha"])
def test_observation_only_bitwise_equal_losses(build: Callable[[], nn.Module]) -> None:
    """Dropout in the model: any use of the global RNG or any change to the call would show."""
    off = train_losses(build, None)
    exact = train_losses(build, config(**EXACT))
    sampled = train_losses(build, config(attn_sample_rows=2, attn_sample_queries=5))
    assert torch.equal(off, exact) and torch.equal(off, sampled)
    if build is BUILDS[0]:  # the check can fail: a single extra RNG draw changes the losses
        assert not torch.equal(off, train_losses(build, None, extra_draw=True))


def test_sampled_max_never_exceeds_exact_and_default_lands_within_ten_percent() -> None:
    """Tiny reference GPT trained on the embedded text; two monitors on the same forward passes:
    default sampling (4 rows, 64 queries of a 16 × 64 batch) and exact."""
    torch.manual_seed(0)
    cfg = preset_config("tiny")
    model = GPT(cfg)
    corpus = load_corpus()
    g = torch.Generator().manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(30):
        idx, tgt = corpus.batch("train", 16, cfg.context, g)
        loss = model.loss(idx, tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()
    sampled = stabkit.attach(model, None, config=config(), logdir=None)
    assert (sampled.config.attn_sample_rows, sampled.config.attn_sample_queries) == (4, 64)  # the defaults
    exact = stabkit.attach(model, None, config=config(**EXACT), logdir=None)
    for _ in range(4):  # the uniform row sample rotates; training forwards (no_grad ones are not measured)
        model(corpus.batch("train", 16, cfg.context, g)[0])
        sampled.step()
        exact.step()
    sampled.detach()
    exact.detach()
    assert len(sampled.history) == len(exact.history) == 4
    paths = stabkit.inspect_model(model).attention_paths
    for (_, s_row), (_, e_row) in zip(sampled.history, exact.history, strict=True):
        for p in paths:
            s, e = s_row[f"attn/{p}/max_logit"], e_row[f"attn/{p}/max_logit"]
            assert e > 2.0  # trained: logits not trivial
            assert s <= e * (1 + 1e-6)
            assert s >= 0.9 * e, f"{p}: sampled max {s} vs exact {e}"
            assert s_row[f"attn/{p}/entropy"] == pytest.approx(e_row[f"attn/{p}/entropy"], rel=0.25)


def test_mode_is_pushed_only_inside_attention_and_only_on_sampled_steps() -> None:
    model = zoo.reference_gpt()
    seen: dict[str, list[int]] = {"attn": [], "mlp": []}
    mon = stabkit.attach(model, None, config=config(every=3), logdir=None)
    block = model.blocks[0]
    block.attn.register_forward_pre_hook(
        lambda m, a: seen["attn"].append(torch._C._len_torch_function_stack())
    )
    block.mlp.register_forward_pre_hook(lambda m, a: seen["mlp"].append(torch._C._len_torch_function_stack()))
    for step in range(4):
        model(zoo.batch(step)[0])
        mon.step()
    mon.flush()
    assert seen["attn"] == [1, 0, 0, 1] and seen["mlp"] == [0, 0, 0, 0]
    assert [step for step, row in mon.history if any(k.startswith("attn/") for k in row)] == [0, 3]
    mon.detach()
    model(zoo.batch(9)[0])
    assert seen["attn"][-1] == 0 and torch._C._len_torch_function_stack() == 0


def test_micro_batches_combine_max_mean_and_min() -> None:
    model = zoo.reference_gpt()
    a, b = zoo.batch(1)[0], zoo.batch(2)[0]

    def measure(*inputs: torch.Tensor) -> dict[str, float]:
        with stabkit.attach(model, None, config=config(**EXACT), logdir=None) as mon:
            for x in inputs:
                model(x)
            mon.step()
            mon.flush()
        return mon.metrics

    one, two, both = measure(a), measure(b), measure(a, b)
    for p in stabkit.inspect_model(model).attention_paths:
        name = f"attn/{p}/"
        assert both[name + "max_logit"] == max(one[name + "max_logit"], two[name + "max_logit"])
        assert both[name + "min_head_entropy"] == min(
            one[name + "min_head_entropy"], two[name + "min_head_entropy"]
        )
        mean = (one[name + "entropy"] + two[name + "entropy"]) / 2
        assert both[name + "entropy"] == pytest.approx(mean, rel=1e-6)
        assert one[name + "min_head_entropy"] != two[name + "min_head_entropy"]


def hand_rolled_attention(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Attention the probe cannot see: exp-normalised scores, no SDPA, no softmax call."""
    bsz, seq, _ = x.shape
    q = self.q_proj(x).view(bsz, seq, self.n_heads, -1).transpose(1, 2)
    k = self.k_proj(x).view(bsz, seq, self.n_heads, -1).transpose(1, 2)
    v = self.v_proj(x).view(bsz, seq, self.n_heads, -1).transpose(1, 2)
    w = (q @ k.transpose(-1, -2)).exp().tril()
    y = (w / w.sum(-1, keepdim=True)) @ v
    return self.o_proj(y.transpose(1, 2).reshape(bsz, seq, -1))


def test_unknown_attention_implementation_warns_once_and_training_continues() -> None:
    model = zoo.reference_gpt()
    model.blocks[1].attn.forward = types.MethodType(hand_rolled_attention, model.blocks[1].attn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mon = stabkit.attach(model, None, config=config(), logdir=None)
        for step in range(3):
            idx, tgt = zoo.batch(step)
            mon.step(zoo.lm_loss(model(idx), tgt))
    mon.flush()
    said = [
        str(w.message)
        for w in caught
        if "stabkit" in str(w.message) and "torch.compile" not in str(w.message)
    ]
    assert len(said) == 1 and "blocks.1.attn" in said[0] and "register_kernel" in said[0], said
    # the readable attention module is measured at every sampled step, the opaque one never
    measured = [step for step, row in mon.history if "attn/blocks.0.attn/max_logit" in row]
    assert measured == [0, 1, 2]
    assert not any(k.startswith("attn/blocks.1.") for _, row in mon.history for k in row)
    assert [step for step, row in mon.history if "loss" in row] == [0, 1, 2]
    mon.detach()


def test_strict_raises_on_unknown_attention_and_on_a_softmax_it_cannot_read() -> None:
    model = zoo.reference_gpt()
    model.blocks[0].attn.forward = types.MethodType(hand_rolled_attention, model.blocks[0].attn)
    with pytest.raises(stabkit.DiscoveryError, match=r"blocks\.0\.attn.*strict mode"):
        stabkit.attach(model, None, config=config(strict=True), logdir=None)
    assert torch._C._len_torch_function_stack() == 0
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())

    def softmax_over_queries(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        scores = self.q_proj(x) @ self.k_proj(x).transpose(-1, -2)  # (B, T, T)
        return self.o_proj(F.softmax(scores[:, None], dim=2)[:, 0] @ self.v_proj(x))

    model = zoo.reference_gpt()
    model.blocks[0].attn.forward = types.MethodType(softmax_over_queries, model.blocks[0].attn)
    with pytest.raises(stabkit.DiscoveryError, match=r"blocks\.0\.attn"):
        stabkit.attach(model, None, config=config(strict=True), logdir=None)

    # a call the probe recognises but cannot read (SDPA on 5-d inputs): strict raises at that forward
    def five_dims(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        bsz, seq, _ = x.shape
        q, k, v = (
            p(x).view(bsz, seq, self.n_heads, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        y = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        return self.o_proj(y.transpose(1, 2).reshape(bsz, seq, -1))

    model = zoo.reference_gpt()
    model.blocks[0].attn.forward = types.MethodType(five_dims, model.blocks[0].attn)
    mon = stabkit.attach(model, None, config=config(strict=True), logdir=None)
    with mon, pytest.raises(ProbeError, match=r"cannot read attention module 'blocks\.0\.attn'.*4-d"):
        model(zoo.batch(0)[0])
    assert torch._C._len_torch_function_stack() == 0  # popped despite the error


class MHABlock(nn.Module):
    """Pre-norm block around a standalone nn.MultiheadAttention (no TransformerEncoderLayer)."""

    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class MHALM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(zoo.VOCAB, 32)
        self.blocks = nn.ModuleList([MHABlock(), MHABlock()])
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, zoo.VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def test_mha_inference_fast_path_is_left_alone_and_training_is_measured() -> None:
    """eval + no_grad: a function mode would divert nn.MultiheadAttention from its fused inference path
    (other rounding), so the probe does not measure there; only training forwards (train mode and
    gradients) are measured, so an eval forward with gradients is not either."""
    torch.manual_seed(0)
    model = MHALM().eval()
    idx = zoo.batch(4)[0]
    with torch.no_grad():
        bare = model(idx)
    mon = stabkit.attach(model, None, config=config(**EXACT), logdir=None)
    with torch.no_grad():
        watched = model(idx)
    mon.step()
    model(idx)  # eval with gradients: not a training forward, not measured
    mon.step()
    model.train()(idx)
    mon.step()
    mon.flush()
    mon.detach()
    assert torch.equal(bare, watched)
    measured = [step for step, row in mon.history if any(k.startswith("attn/") for k in row)]
    assert measured == [2]
