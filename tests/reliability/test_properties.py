"""Property-based: over random reference GPTs and nn.TransformerEncoder configs, attaching stabkit
changes no bit of training and detaching leaves no hook behind."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from zoo import EncoderLM, lm_loss

import stabkit
from stabkit.harness.models import GPT, GPTConfig

from ..monitor.test_monitor import hook_state

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def gpt_configs(draw: st.DrawFn) -> GPTConfig:
    heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([4, 8]))
    return GPTConfig(
        vocab_size=draw(st.integers(8, 40)),
        context=8,
        d_model=heads * head_dim,
        n_layers=draw(st.integers(1, 3)),
        n_heads=heads,
        n_kv_heads=draw(st.sampled_from([d for d in (1, 2, 4) if heads % d == 0])),
        norm_placement=draw(st.sampled_from(["pre", "post", "sandwich"])),
        norm=draw(st.sampled_from(["layernorm", "rmsnorm"])),
        mlp=draw(st.sampled_from(["gelu", "swiglu"])),
        positions=draw(st.sampled_from(["learned", "rope"])),
        bias=draw(st.booleans()),
        qk_norm=draw(st.booleans()),
        attn_softcap=draw(st.sampled_from([None, 5.0])),
        logit_softcap=draw(st.sampled_from([None, 10.0])),
        dropout=draw(st.sampled_from([0.0, 0.2])),
    )


def train(
    model: nn.Module, vocab: int, attach: bool, every: int
) -> tuple[list[float], list[torch.Tensor], torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = hook_state(model, opt)
    mon = (
        stabkit.attach(model, opt, config=stabkit.MonitorConfig(every=every, log_every=2, console=False))
        if attach
        else None
    )
    losses = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        data = torch.randint(0, vocab, (2, 9), generator=gen)
        out = model(data[:, :-1])
        loss = lm_loss(out, data[:, 1:])
        loss.backward()
        opt.step()
        if mon is not None:
            mon.step(loss)
        opt.zero_grad()
        losses.append(loss.item())
    if mon is not None:
        mon.detach()
    assert hook_state(model, opt) == before
    return losses, [p.detach().clone() for p in model.parameters()], torch.rand(2)


def same(
    a: tuple[list[float], list[torch.Tensor], torch.Tensor],
    b: tuple[list[float], list[torch.Tensor], torch.Tensor],
) -> bool:
    return a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[1], b[1])) and torch.equal(a[2], b[2])


@SETTINGS
@given(cfg=gpt_configs(), every=st.integers(1, 2))
def test_reference_gpt_observation_only(cfg: GPTConfig, every: int) -> None:
    runs = []
    for attach in (False, True):
        torch.manual_seed(0)
        runs.append(train(GPT(cfg), cfg.vocab_size, attach, every))
    assert same(runs[0], runs[1])


@SETTINGS
@given(
    heads=st.sampled_from([1, 2, 4]),
    layers=st.integers(1, 3),
    norm_first=st.booleans(),
    dropout=st.sampled_from([0.0, 0.1]),
)
def test_transformer_encoder_observation_only(
    heads: int, layers: int, norm_first: bool, dropout: float
) -> None:
    def build() -> nn.Module:
        model = EncoderLM(d=32, n_layer=layers, n_head=heads, vocab=20, norm_first=norm_first)
        for layer in model.encoder.layers:
            layer.dropout.p = layer.dropout1.p = layer.dropout2.p = dropout
        return model

    runs = []
    for attach in (False, True):
        torch.manual_seed(0)
        runs.append(train(build(), 20, attach, 1))
    assert same(runs[0], runs[1])
