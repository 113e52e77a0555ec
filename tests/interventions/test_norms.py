"""norm_placement and rmsnorm against independent references: the reference GPT built with the target
placement / norm and the same weights, hand-composed blocks, and the wiring seen through hooks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import zoo
from torch import nn

from stabkit.interventions import InterventionError, apply


def _randomise_norms(model: nn.Module) -> None:
    """Non-trivial gains and biases, so a norm in the wrong place shows."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm) or "RMSNorm" in type(m).__name__:
                m.weight.uniform_(0.5, 1.5)
                if getattr(m, "bias", None) is not None:
                    m.bias.uniform_(-0.3, 0.3)


# ---------------------------------------------------------------- reference GPT: exact against GPTConfig
@pytest.mark.parametrize(
    ("src", "to"), [("pre", "post"), ("post", "pre"), ("sandwich", "pre"), ("sandwich", "post")]
)
def test_reference_gpt_switch_equals_config_built(src: str, to: str) -> None:
    torch.manual_seed(0)
    mine = zoo.reference_gpt(norm_placement=src)
    _randomise_norms(mine)
    built = zoo.reference_gpt(norm_placement=to)
    built.load_state_dict(
        mine.state_dict(), strict=src != "sandwich"
    )  # sandwich norms have no slot in `built`
    idx, _ = zoo.batch(0)
    base = mine(idx)
    handle = apply(mine, "norm_placement", to=to)
    assert torch.equal(mine(idx), built(idx))
    handle.remove()
    assert torch.equal(mine(idx), base)


@pytest.mark.parametrize("src", ["pre", "post"])
def test_reference_gpt_sandwich_equals_config_built(src: str) -> None:
    torch.manual_seed(0)
    mine = zoo.reference_gpt(norm_placement=src)
    _randomise_norms(mine)
    handle = apply(mine, "norm_placement", to="sandwich")
    assert len(handle.new_parameters()) == 4 and all(
        torch.equal(p, torch.ones(32)) for p in handle.new_parameters()
    )
    built = zoo.reference_gpt(norm_placement="sandwich")  # fresh sandwich norms: gain 1, like ours
    built.load_state_dict(mine.state_dict())  # strict: same keys (post_norm1/post_norm2)
    idx, _ = zoo.batch(0)
    assert torch.equal(mine(idx), built(idx))


# ---------------------------------------------------------------- hand-composed / wiring checks
def _nano_hand(model: zoo.NanoGPT, idx: torch.Tensor, to: str) -> torch.Tensor:
    t = model.transformer
    x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))
    for b in t.h:
        if to == "post":
            x = b.ln_1(x + b.attn.forward(x))
            x = b.ln_2(x + b.mlp.forward(x))
        else:  # sandwich: the new output norms have gain 1, bias 0: a plain LayerNorm
            ln = nn.functional.layer_norm
            x = x + ln(b.attn.forward(b.ln_1(x)), (32,), eps=1e-5)
            x = x + ln(b.mlp.forward(b.ln_2(x)), (32,), eps=1e-5)
    return model.lm_head(t.ln_f(x))


@pytest.mark.parametrize("to", ["post", "sandwich"])
def test_nanogpt_placement_equals_hand_composition(to: str) -> None:
    torch.manual_seed(0)
    model = zoo.NanoGPT()
    _randomise_norms(model)
    idx, _ = zoo.batch(0)
    apply(model, "norm_placement", to=to)
    # `.forward` in the hand version bypasses the sandwich hooks on attn/mlp
    torch.testing.assert_close(model(idx), _nano_hand(model, idx, to), rtol=1e-5, atol=1e-6)


def _record(module: nn.Module, name: str, store: dict[str, Any]) -> Any:
    def pre(mod: nn.Module, args: Any, kwargs: Any) -> None:
        store[f"{name}.in"] = args[0] if args else kwargs["hidden_states"]

    def post(mod: nn.Module, args: Any, out: Any) -> None:
        store[f"{name}.out"] = out[0] if isinstance(out, tuple) else out

    return [module.register_forward_pre_hook(pre, with_kwargs=True), module.register_forward_hook(post)]


@pytest.mark.parametrize("family", ["hf_gpt2", "hf_llama"])
def test_hf_post_norm_wiring(family: str) -> None:
    torch.manual_seed(0)
    model = (zoo.hf_gpt2 if family == "hf_gpt2" else zoo.hf_llama)("sdpa").eval()
    _randomise_norms(model)
    blocks = model.transformer.h if family == "hf_gpt2" else model.model.layers
    apply(model, "norm_placement", to="post")
    seen: dict[str, Any] = {}
    for i, block in enumerate(blocks):
        attn = block.attn if family == "hf_gpt2" else block.self_attn
        norms = (
            (block.ln_1, block.ln_2)
            if family == "hf_gpt2"
            else (block.input_layernorm, block.post_attention_layernorm)
        )
        _record(block, f"{i}.block", seen)
        _record(attn, f"{i}.attn", seen)
        _record(block.mlp, f"{i}.mlp", seen)
        seen[f"{i}.norms"] = norms
    model(zoo.batch(0)[0])
    for i in range(len(blocks)):
        norm_a, norm_m = seen[f"{i}.norms"]
        x = seen[f"{i}.block.in"]
        assert torch.equal(seen[f"{i}.attn.in"], x)  # attention reads the raw residual stream
        h = norm_a(x + seen[f"{i}.attn.out"])
        torch.testing.assert_close(seen[f"{i}.mlp.in"], h)
        torch.testing.assert_close(seen[f"{i}.block.out"], norm_m(h + seen[f"{i}.mlp.out"]))


def test_encoder_pre_from_post_equals_norm_first_model() -> None:
    torch.manual_seed(0)
    post = zoo.EncoderLM().eval()
    _randomise_norms(post)
    pre = zoo.EncoderLM(norm_first=True).eval()
    pre.load_state_dict(post.state_dict())
    idx, _ = zoo.batch(0)
    apply(post, "norm_placement", to="pre")
    with torch.no_grad():
        torch.testing.assert_close(post(idx), pre(idx), rtol=1e-5, atol=1e-6)


def test_encoder_sandwich_wiring() -> None:
    torch.manual_seed(0)
    model = zoo.EncoderLM().eval()
    _randomise_norms(model)
    handle = apply(model, "norm_placement", to="sandwich")
    _randomise_norms(model)  # the new output norms too
    layer = model.encoder.layers[0]
    seen: dict[str, Any] = {}
    _record(layer, "layer", seen)
    _record(layer.linear1, "ff", seen)
    model(zoo.batch(0)[0])
    x = seen["layer.in"]
    mask = nn.Transformer.generate_square_subsequent_mask(16)
    h = layer.norm1(x)
    sa = layer.self_attn.forward(h, h, h, attn_mask=mask, need_weights=False)[0]  # .forward: no hooks
    x1 = x + layer.stabkit_post_attn_norm(sa)
    torch.testing.assert_close(seen["ff.in"], layer.norm2(x1))
    ff = layer.linear2.forward(layer.activation(seen["ff.in"] @ layer.linear1.weight.T + layer.linear1.bias))
    torch.testing.assert_close(seen["layer.out"], x1 + layer.stabkit_post_mlp_norm(ff))
    handle.remove()


def test_post_on_unknown_wiring_is_refused() -> None:
    class Block(nn.Module):  # a pre-norm block whose class stabkit does not know
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.self_attention = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(x)
            return x + self.self_attention(h, h, h)[0]

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    model = Model()
    with pytest.raises(InterventionError, match=r"norm_placement.*example="):
        apply(model, "norm_placement", to="post")  # names only: refused, a trace is needed
    with pytest.raises(InterventionError, match=r"norm_placement.*layers\.0.*residual wiring"):
        apply(model, "norm_placement", to="post", example=torch.randn(2, 5, 8))


# ---------------------------------------------------------------- rmsnorm
def test_rmsnorm_reference_gpt_equals_config_built_and_keeps_gains() -> None:
    torch.manual_seed(0)
    mine = zoo.reference_gpt()
    _randomise_norms(mine)
    gains = {n: m.weight for n, m in mine.named_modules() if isinstance(m, nn.LayerNorm)}
    built = zoo.reference_gpt(norm="rmsnorm")
    built.load_state_dict(mine.state_dict())
    apply(mine, "rmsnorm")
    assert all(mine.get_submodule(n).weight is w for n, w in gains.items())  # same Parameter objects
    idx, _ = zoo.batch(0)
    torch.testing.assert_close(mine(idx), built(idx), rtol=0, atol=0)


def test_rmsnorm_equals_hand_formula() -> None:
    torch.manual_seed(0)
    model = zoo.NanoGPT()
    _randomise_norms(model)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.bias.zero_()
    apply(model, "rmsnorm")
    norm = model.transformer.h[0].ln_1
    x = torch.randn(3, 5, 32) * 4 + 1  # a mean offset: LayerNorm and RMSNorm differ
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), want)
    assert not torch.allclose(nn.functional.layer_norm(x, (32,), norm.weight, eps=1e-5), want, atol=1e-3)


def test_rmsnorm_refuses_nonzero_bias_unless_dropped() -> None:
    torch.manual_seed(0)
    model = zoo.hf_gpt2()
    _randomise_norms(model)  # non-zero LayerNorm biases
    keys = list(model.state_dict())
    with pytest.raises(InterventionError, match=r"rmsnorm.*transformer\.h\.0\.ln_1.*drop_bias=True"):
        apply(model, "rmsnorm")
    assert list(model.state_dict()) == keys
    handle = apply(model, "rmsnorm", drop_bias=True)
    assert not any(k.endswith("ln_1.bias") for k in model.state_dict())
    handle.remove()
    assert list(model.state_dict()) == keys
