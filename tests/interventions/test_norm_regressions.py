"""Regressions of norm_placement, rmsnorm and the norm helpers, each against an independent expectation:

- sandwich / post on a LLaMA-style model whose attention calls SDPA through a parameter-free child
  module (the norm went on the child's (B, T, H, hd) output; post called the child with the block input);
- a norm whose width cannot be told: InterventionError naming the intervention and the norm, not ValueError;
- rmsnorm on nanoGPT's own ``LayerNorm`` class (refused as "no nn.LayerNorm" before), and classes that
  are not a layer norm over the last dim left alone (a channels-first nn.LayerNorm subclass was swapped);
- hybrid models: blocks without attention (a causal conv mixer) get their output norm on the mixer, or
  are refused naming the block; unmapped layers or sub-layers are refused, never skipped silently.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from zoo_models import ZOO
from zoo_models.handwritten import DIM, HEADS, Block, GPTBase, merge_heads, mlp, split_heads

import stabkit
from stabkit.discovery.modelmap import ModelMap, NormMap
from stabkit.interventions import InterventionError, apply
from stabkit.interventions.common import norm_like, norm_width
from stabkit.layers import RMSNorm

torch.set_num_threads(1)


def _zoo(name: str) -> tuple[nn.Module, torch.Tensor]:
    z = ZOO[name]()
    return z.model, z.args[0]


def _randomise(model: nn.Module, bias: bool = True) -> None:
    """Non-trivial gains (and biases), so a norm in the wrong place shows."""
    with torch.no_grad():
        for m in model.modules():
            if "Norm" in type(m).__name__:
                for name, p in m.named_parameters(recurse=False):
                    if name == "weight":
                        p.uniform_(0.5, 1.5)
                    elif name == "bias":
                        p.uniform_(-0.3, 0.3) if bias else p.zero_()


def _zero_new_gains(handle: Any) -> None:
    with torch.no_grad():
        for p in handle.new_parameters():
            p.zero_()


def _blocks_are_identity(model: nn.Module, idx: torch.Tensor, blocks: list[nn.Module]) -> None:
    """Every block returns its input: each sub-layer's output went through a zero-gain norm."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    hooks = [b.register_forward_hook(lambda m, a, o: seen.append((a[0], o))) for b in blocks]
    with torch.no_grad():
        model(idx)
    for h in hooks:
        h.remove()
    assert len(seen) == len(blocks)
    for x, y in seen:
        torch.testing.assert_close(y, x, rtol=0, atol=0)


# ------------------------------------------------------------------ 1. SDPA through a child module
def _child_sdpa(mapped: str) -> tuple[nn.Module, torch.Tensor, ModelMap | None]:
    """The model, its input, and the map to apply with: None (discovery's own, traced on the input) or
    one naming the SDPA-calling child as the attention, as discovery did before it learned to lift
    the call to the module holding q/k (placement must still find the attention's output)."""
    torch.manual_seed(0)
    model, idx = _zoo("hand-child-sdpa")
    _randomise(model)
    mmap = stabkit.inspect_model(model, example=idx)
    if mapped == "discovered":
        return model, idx, None
    mmap = copy.deepcopy(mmap)
    for b in mmap.blocks:
        assert b.attention is not None
        b.attention.path, b.attention.out, b.attention.v = f"{b.path}.self_attn.sdpa", None, None
    return model, idx, mmap


def test_child_sdpa_outputs_the_heads_not_the_sublayer_output() -> None:
    """What makes the case: the module calling SDPA returns (B, T, H, hd)."""
    model, idx, _ = _child_sdpa("discovered")
    out: list[torch.Tensor] = []
    h = model.layers[0].self_attn.sdpa.register_forward_hook(lambda m, i, o: out.append(o))
    with torch.no_grad():
        model(idx)
    h.remove()
    assert out[0].shape == (*idx.shape, HEADS, DIM // HEADS)


@pytest.mark.parametrize("mapped", ["discovered", "at-child"])
def test_sandwich_on_child_sdpa_norms_the_attention_output(mapped: str) -> None:
    model, idx, mmap = _child_sdpa(mapped)
    with torch.no_grad():
        before = model(idx)
    handle = apply(model, "norm_placement", to="sandwich", model_map=mmap)
    layer = model.layers[0]
    assert layer.self_attn._forward_hooks and not layer.self_attn.sdpa._forward_hooks
    # independent: the block by hand, x + rms(attn(norm_in(x))) with a fresh gain-1 RMSNorm (eps 1e-6)
    x = torch.randn(2, 7, DIM)
    rms = lambda t: F.rms_norm(t, (DIM,), eps=1e-6)  # noqa: E731
    h = x + rms(layer.self_attn.forward(layer.input_layernorm(x)))  # .forward: the module's own hooks skipped
    want = h + rms(layer.mlp.forward(layer.post_attention_layernorm(h)))
    with torch.no_grad():
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-6)
    _zero_new_gains(handle)
    _blocks_are_identity(model, idx, list(model.layers))
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(idx), before)


@pytest.mark.parametrize("mapped", ["discovered", "at-child"])
def test_post_on_child_sdpa_rewires_the_attention_module(mapped: str) -> None:
    model, idx, mmap = _child_sdpa(mapped)
    reference = copy.deepcopy(model)
    handle = apply(model, "norm_placement", to="post", model_map=mmap)
    for layer in reference.layers:  # independent: post-norm by hand on an untouched copy

        def post(x: torch.Tensor, b: nn.Module = layer) -> torch.Tensor:
            h = b.input_layernorm(x + b.self_attn(x))
            return b.post_attention_layernorm(h + b.mlp(h))

        layer.forward = post
    with torch.no_grad():
        torch.testing.assert_close(model(idx), reference(idx), rtol=0, atol=0)
    handle.remove()


class HeadsOut(nn.Module):
    """Parameter-free: q, k, v -> merged heads (B, T, d); the out projection is in the block's forward."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class OutProjInBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.attn = HeadsOut()
        self.mlp = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(t) for t in self.qkv(self.norm1(x)).split(DIM, dim=-1))
        x = x + self.proj(self.attn(q, k, v))
        return x + self.mlp(self.norm2(x))


class WideHeads(nn.Module):
    """Attention whose output is its heads, 2·d wide (the out projection is in the block's forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 6 * DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(t) for t in self.qkv(x).split(2 * DIM, dim=-1))
        return merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class WideBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn, self.proj, self.mlp = WideHeads(), nn.Linear(2 * DIM, DIM), mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.proj(self.attn(self.norm1(x)))
        return x + self.mlp(self.norm2(x))


class Stack(GPTBase):
    def __init__(self, make: Any, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(make() for _ in range(n))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_sandwich_when_the_block_applies_the_out_projection() -> None:
    """The attention module holds no out projection (the block applies it): as mapped by discovery
    (the call inline in the block, its output the block's ``proj``) the norm goes on ``proj``'s output;
    a map naming the parameter-free child is refused, as no module between it and the block outputs
    the sub-layer (never a norm on the child's output, which is not what the residual adds)."""
    torch.manual_seed(0)
    model, idx = Stack(OutProjInBlock), torch.randint(0, 96, (2, 12))
    mmap = copy.deepcopy(stabkit.inspect_model(model, example=idx))
    for b in mmap.blocks:
        assert b.attention is not None
        b.attention.path, b.attention.output = f"{b.path}.attn", None
    keys = list(model.state_dict())
    with pytest.raises(
        InterventionError,
        match=r"norm_placement: cannot apply to layers\.0\.attn: no module from 'layers\.0\.attn' .*width 32",
    ):
        apply(model, "norm_placement", to="sandwich", model_map=mmap)
    assert list(model.state_dict()) == keys and not model.layers[0].attn._forward_hooks
    try:
        handle = apply(model, "norm_placement", to="sandwich")
    except InterventionError as exc:  # discovery naming the child: refused the same way
        assert "width 32" in str(exc) or "inline" in str(exc)
        return
    assert not model.layers[0].attn._forward_hooks
    _zero_new_gains(handle)
    _blocks_are_identity(model, idx, list(model.layers))
    handle.remove()


def test_a_norm_is_never_hooked_onto_an_output_of_another_width() -> None:
    """The attention module's output is 2·d wide: refused (at apply, or at the latest at the first
    forward) with InterventionError, never a RuntimeError from inside the norm."""
    torch.manual_seed(0)
    model, idx = Stack(WideBlock), torch.randint(0, 96, (2, 12))
    stabkit.inspect_model(model, example=idx)
    with pytest.raises(InterventionError, match=r"norm_placement: .*layers\.0\.attn.*width 32"):
        handle = apply(model, "norm_placement", to="sandwich")
        try:
            model(idx)
        finally:
            handle.remove()


# ------------------------------------------------------------------ 2. norm width
class OwnLayerNorm(nn.Module):
    """nanoGPT's LayerNorm: weight and optional bias, no normalized_shape, eps in the forward."""

    def __init__(self, ndim: int, bias: bool, weight: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim)) if weight else None
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, 1e-5)


class ScaleNorm(nn.Module):
    """A norm with one scalar gain: its width cannot be told."""

    def __init__(self) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.g * x / x.norm(dim=-1, keepdim=True).clamp_min(1e-5) * x.shape[-1] ** 0.5


@pytest.mark.parametrize(("weight", "bias"), [(True, True), (True, False), (False, True)])
def test_norm_width_from_gain_or_bias(weight: bool, bias: bool) -> None:
    assert norm_width(OwnLayerNorm(24, bias, weight)) == 24


def test_norm_width_unknown_is_an_intervention_error() -> None:
    with pytest.raises(
        InterventionError, match=r"norm_placement: cannot apply to blocks\.0\.norm: .*ScaleNorm"
    ):
        norm_width(ScaleNorm(), "norm_placement", "blocks.0.norm")
    with pytest.raises(InterventionError, match=r"has no gain of width 8"):
        norm_like("norm_placement", ScaleNorm(), "blocks.0.norm", 8)


class ScaleNormBlock(Block):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = ScaleNorm(), ScaleNorm()


def test_sandwich_with_norms_of_unknown_width_is_refused_naming_the_norm() -> None:
    model, idx = Stack(ScaleNormBlock), torch.randint(0, 96, (2, 12))
    assert stabkit.inspect_model(model, example=idx).blocks[0].placement == "pre"
    keys = list(model.state_dict())
    with pytest.raises(
        InterventionError, match=r"norm_placement: cannot apply to layers\.0\.norm1: .*width of ScaleNorm"
    ) as exc:
        apply(model, "norm_placement", to="sandwich")
    assert type(exc.value) is InterventionError
    assert list(model.state_dict()) == keys


def test_sandwich_on_nanogpt_own_layernorm_class() -> None:
    torch.manual_seed(0)
    model, idx = _zoo("hand-nanogpt-layernorm-class")
    _randomise(model)
    stabkit.inspect_model(model, example=idx)
    handle = apply(model, "norm_placement", to="sandwich")
    block = model.transformer.h[0]
    x = torch.randn(2, 5, DIM)
    ln = lambda t: F.layer_norm(t, (DIM,), eps=1e-5)  # noqa: E731  the new norms: gain 1, bias 0, eps 1e-5
    h = x + ln(block.attn.forward(block.ln_1(x)))
    with torch.no_grad():
        torch.testing.assert_close(block(x), h + ln(block.mlp.forward(block.ln_2(h))), rtol=1e-5, atol=1e-6)
    _zero_new_gains(handle)
    _blocks_are_identity(model, idx, list(model.transformer.h))
    handle.remove()


# ------------------------------------------------------------------ 3. rmsnorm on layer-norm classes
def test_rmsnorm_swaps_nanogpt_own_layernorm_class() -> None:
    torch.manual_seed(0)
    model, idx = _zoo("hand-nanogpt-layernorm-class")
    _randomise(model, bias=False)
    with torch.no_grad():
        before = model(idx)
    paths = [n for n, m in model.named_modules() if type(m).__name__ == "LayerNorm"]
    gains = {n: model.get_submodule(n).weight for n in paths}
    assert len(paths) == 5
    reference = copy.deepcopy(model)
    for n in paths:  # independent: each LayerNorm's forward replaced by the RMSNorm formula, eps 1e-5
        norm = reference.get_submodule(n)
        norm.forward = lambda t, w=norm.weight: t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    handle = apply(model, "rmsnorm")
    for n in paths:
        new = model.get_submodule(n)
        assert isinstance(new, RMSNorm) and new.weight is gains[n] and new.eps == pytest.approx(1e-5)
    with torch.no_grad():
        torch.testing.assert_close(model(idx), reference(idx), rtol=1e-5, atol=1e-6)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(idx), before)
    assert all(model.get_submodule(n).weight is gains[n] for n in paths)


def test_rmsnorm_on_layernorm_class_refuses_nonzero_bias_unless_dropped() -> None:
    torch.manual_seed(0)
    model, _ = _zoo("hand-nanogpt-layernorm-class")
    _randomise(model)
    keys = list(model.state_dict())
    with pytest.raises(
        InterventionError, match=r"rmsnorm: cannot apply to transformer\.h\.0\.ln_1: .*drop_bias=True"
    ):
        apply(model, "rmsnorm")
    assert list(model.state_dict()) == keys
    handle = apply(model, "rmsnorm", drop_bias=True)
    assert not any(k.endswith("ln_1.bias") for k in model.state_dict())
    handle.remove()
    assert list(model.state_dict()) == keys


class HardEpsLayerNorm(OwnLayerNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, 1e-12)


class FakeLayerNorm(nn.Module):
    """Named a layer norm, computes an RMSNorm (as HF's T5LayerNorm)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class ChannelsFirstLayerNorm(nn.LayerNorm):
    """An nn.LayerNorm subclass normalising dim 1 of (B, C, T) (as timm's LayerNorm2d)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.transpose(1, -1)).transpose(1, -1)


class Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.own = HardEpsLayerNorm(8, bias=False)
        self.fake = FakeLayerNorm(8)
        self.cf = ChannelsFirstLayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.cf(self.fake(self.own(self.ln(x))).transpose(1, 2)).transpose(1, 2)


def test_rmsnorm_swaps_only_modules_that_are_layer_norms_over_the_last_dim() -> None:
    torch.manual_seed(0)
    model = Mixed()
    _randomise(model, bias=False)
    x = torch.randn(2, 5, 8) + 0.5
    with torch.no_grad():
        before = model(x)
    fake, cf = model.fake, model.cf
    with pytest.warns(
        RuntimeWarning,
        match=r"rmsnorm left 2 module\(s\).*fake \(FakeLayerNorm\).*cf \(ChannelsFirstLayerNorm\)",
    ):
        handle = apply(model, "rmsnorm")
    assert isinstance(model.ln, RMSNorm) and isinstance(model.own, RMSNorm)
    assert model.own.eps == pytest.approx(1e-12, rel=1e-3)  # read off the output: no eps attribute
    assert model.fake is fake and model.cf is cf
    with torch.no_grad():
        want = cf(
            fake(
                F.rms_norm(F.rms_norm(x, (8,), model.ln.weight, 1e-5), (8,), model.own.weight, 1e-12)
            ).transpose(1, 2)
        ).transpose(1, 2)
        torch.testing.assert_close(model(x), want)
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(x), before)


def test_rmsnorm_refused_when_no_layer_norm_can_be_swapped() -> None:
    model = nn.Sequential(nn.Linear(8, 8), FakeLayerNorm(8))
    with pytest.raises(
        InterventionError,
        match=r"rmsnorm: cannot apply to 1: no nn\.LayerNorm found.*FakeLayerNorm.*not F\.layer_norm",
    ):
        apply(model, "rmsnorm")
    assert isinstance(model[1], FakeLayerNorm)


# ------------------------------------------------------------------ 4. hybrids: blocks without attention
def _hybrid() -> tuple[nn.Module, torch.Tensor, ModelMap]:
    torch.manual_seed(0)
    model, idx = _zoo("hand-hybrid-conv")
    _randomise(model)
    return model, idx, stabkit.inspect_model(model, example=idx)


def test_hybrid_discovery_maps_the_conv_blocks_without_attention() -> None:
    _, _, mmap = _hybrid()
    conv = mmap.blocks[0]
    assert [b.path for b in mmap.blocks] == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert conv.attention is None and conv.attentions == [] and conv.mixer == "layers.0.mixer"
    assert conv.mlp == "layers.0.mlp" and mmap.blocks[1].attention is not None


@pytest.mark.parametrize("to", ["post", "pre"])
def test_hybrid_blocks_without_attention_refuse_pre_and_post_naming_the_block(to: str) -> None:
    model, _, mmap = _hybrid()
    mmap = _pre_norm_map(mmap)
    for b in mmap.blocks:  # a post-norm model for to="pre" (none of its blocks is pre-norm already)
        b.placement = "post" if to == "pre" else b.placement
    keys = list(model.state_dict())
    with pytest.raises(
        InterventionError,
        match=rf"norm_placement: cannot apply to layers\.0: block without attention .*switching it to {to}-norm",
    ):
        apply(model, "norm_placement", to=to, model_map=mmap)
    assert list(model.state_dict()) == keys


def test_hybrid_sandwich_as_discovered_is_refused_naming_the_block_or_verified() -> None:
    model, idx, mmap = _hybrid()
    if mmap.blocks[0].placement == "pre":  # discovery placed the conv blocks' norms: it must apply
        handle = apply(model, "norm_placement", to="sandwich")
        _zero_new_gains(handle)
        _blocks_are_identity(model, idx, list(model.layers))
        handle.remove()
        return
    keys = list(model.state_dict())
    with pytest.raises(
        InterventionError,
        match=r"norm_placement: cannot apply to layers\.0: block without attention.*placement is unknown",
    ):
        apply(model, "norm_placement", to="sandwich")
    assert list(model.state_dict()) == keys and not model.layers[0].mixer._forward_hooks


def _pre_norm_map(mmap: ModelMap) -> ModelMap:
    """The discovered map with the conv blocks' norms placed (what discovery should find): pre-norm,
    norm1 guarding the mixer, norm2 the MLP."""
    mmap = copy.deepcopy(mmap)
    for b in mmap.blocks:
        if b.attention is None:
            b.placement = "pre"
            b.norms = [
                NormMap(f"{b.path}.norm1", "layernorm", "mixer", "pre"),
                NormMap(f"{b.path}.norm2", "layernorm", "mlp", "pre"),
            ]
    return mmap


def test_hybrid_sandwich_norms_the_mixer_output() -> None:
    model, idx, mmap = _hybrid()
    with torch.no_grad():
        before = model(idx)
    handle = apply(model, "norm_placement", to="sandwich", model_map=_pre_norm_map(mmap))
    conv = model.layers[0]
    assert hasattr(conv, "stabkit_post_mixer_norm") and conv.mixer._forward_hooks
    x = torch.randn(2, 7, DIM)
    ln = lambda t: F.layer_norm(t, (DIM,), eps=1e-5)  # noqa: E731
    h = x + ln(conv.mixer.forward(conv.norm1(x)))
    with torch.no_grad():
        torch.testing.assert_close(conv(x), h + ln(conv.mlp.forward(conv.norm2(h))), rtol=1e-5, atol=1e-6)
    _zero_new_gains(handle)
    _blocks_are_identity(model, idx, list(model.layers))  # conv and attention blocks alike
    handle.remove()
    with torch.no_grad():
        assert torch.equal(model(idx), before)


def test_mixer_block_without_mlp_is_refused() -> None:
    model, _, mmap = _hybrid()
    mmap = _pre_norm_map(mmap)
    mmap.blocks[2].mlp = None
    with pytest.raises(InterventionError, match=r"cannot apply to layers\.2: no mlp module"):
        apply(model, "norm_placement", to="sandwich", model_map=mmap)
    assert not hasattr(model.layers[0], "stabkit_post_mixer_norm")  # the blocks done first are undone


def test_unmapped_layer_of_the_blocks_class_is_refused() -> None:
    model, idx = _zoo("hand-child-sdpa")
    mmap = copy.deepcopy(stabkit.inspect_model(model, example=idx))
    mmap.blocks = mmap.blocks[:1]  # as for a hybrid whose other layers discovery did not see
    with pytest.raises(InterventionError, match=r"cannot apply to layers\.1: a layer of the blocks' class"):
        apply(model, "norm_placement", to="sandwich", model_map=mmap)
    assert not hasattr(model.layers[0], "stabkit_post_attn_norm")


class ParallelMixerBlock(Block):
    """Falcon-H1-like: a conv mixer beside the attention on the same normed input."""

    def __init__(self) -> None:
        super().__init__()
        from zoo_models.handwritten import CausalConvMixer

        self.conv_mixer = CausalConvMixer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h) + self.conv_mixer(h)
        return x + self.ff(self.norm2(x))


def _parallel_mixer() -> tuple[nn.Module, torch.Tensor, ModelMap]:
    torch.manual_seed(0)
    model, idx = Stack(ParallelMixerBlock), torch.randint(0, 96, (2, 12))
    _randomise(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model, idx, stabkit.inspect_model(model, example=idx)


def test_sandwich_norms_a_mixer_beside_the_attention() -> None:
    model, idx, mmap = _parallel_mixer()
    if mmap.blocks[0].mixer is None:  # discovery does not see the parallel mixer: refused, as below
        with pytest.raises(InterventionError, match=r"cannot apply to layers\.0: its child 'conv_mixer'"):
            apply(model, "norm_placement", to="sandwich")
        return
    assert mmap.blocks[0].mixer == "layers.0.conv_mixer"
    handle = apply(model, "norm_placement", to="sandwich")
    block = model.layers[0]
    x = torch.randn(2, 7, DIM)
    ln = lambda t: F.layer_norm(t, (DIM,), eps=1e-5)  # noqa: E731
    h = block.norm1(x)
    x1 = x + ln(block.attn.forward(h)) + ln(block.conv_mixer.forward(h))
    with torch.no_grad():
        torch.testing.assert_close(block(x), x1 + ln(block.ff.forward(block.norm2(x1))), rtol=1e-5, atol=1e-6)
    _zero_new_gains(handle)
    _blocks_are_identity(model, idx, list(model.layers))
    handle.remove()


def test_unmapped_sublayer_beside_the_attention_is_refused() -> None:
    model, _, mmap = _parallel_mixer()
    mmap = copy.deepcopy(mmap)
    for b in mmap.blocks:
        b.mixer = None  # a map that misses the mixer (as discovery did before it looked for one)
    keys = list(model.state_dict())
    with pytest.raises(InterventionError, match=r"cannot apply to layers\.0: its child 'conv_mixer'"):
        apply(model, "norm_placement", to="sandwich", model_map=mmap)
    assert list(model.state_dict()) == keys
