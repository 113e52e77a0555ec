"""Every intervention on every zoo family where it applies: it changes the model, and apply → remove
restores outputs, parameters (same objects, same values) and state_dict keys bitwise."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import zoo
from torch import nn

from stabkit.interventions import InterventionError, active_interventions, apply


def _loud(model: nn.Module) -> nn.Module:
    """HF initialises with std 0.02, so attention logits are ~0; widen the weights so caps bite."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "reference": zoo.reference_gpt,
    "reference_rope_gqa": lambda: zoo.reference_gpt(positions="rope", n_kv_heads=2),
    "nanogpt": zoo.NanoGPT,
    "hf_gpt2_sdpa": lambda: _loud(zoo.hf_gpt2("sdpa")),
    "hf_gpt2_eager": lambda: _loud(zoo.hf_gpt2("eager")),
    "hf_llama_sdpa": lambda: _loud(zoo.hf_llama("sdpa")),
    "hf_llama_eager": lambda: _loud(zoo.hf_llama("eager")),
    "encoder_post": zoo.EncoderLM,
    "encoder_pre": lambda: zoo.EncoderLM(norm_first=True),
}
CASES: list[tuple[str, dict]] = [
    ("rmsnorm", {}),
    ("norm_placement", {"to": "pre"}),
    ("norm_placement", {"to": "post"}),
    ("norm_placement", {"to": "sandwich"}),
    ("qk_norm", {}),
    ("qk_norm", {"kind": "layernorm"}),
    ("attn_softcap", {"cap": 0.5}),
    ("logit_softcap", {"cap": 0.5}),
    ("z_loss", {"coef": 1.0}),
]
# (family, intervention, options) that must be refused, with a reason the error names
REFUSED = {
    ("hf_llama_sdpa", "rmsnorm"): "no nn.LayerNorm",
    ("hf_llama_eager", "rmsnorm"): "no nn.LayerNorm",
    ("encoder_post", "norm_placement:post"): "post-norm already",
    ("encoder_pre", "norm_placement:pre"): "pre-norm already",
}
for fam in FAMILIES:
    if not fam.startswith("encoder"):
        REFUSED[(fam, "norm_placement:pre")] = "pre-norm already"


def _key(name: str, options: dict) -> str:
    return f"{name}:{options['to']}" if name == "norm_placement" else name


def _grads(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    zoo.lm_loss(zoo.forward_logits(model, idx), tgt).backward()
    grads = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def _hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize(("name", "options"), CASES, ids=[_key(n, o) for n, o in CASES])
def test_apply_changes_and_remove_restores(family: str, name: str, options: dict) -> None:
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    idx, tgt = zoo.batch(1)
    with torch.no_grad():  # also the inference fast paths (nn.TransformerEncoderLayer)
        base = zoo.forward_logits(model, idx)
    base_grads = _grads(model, idx, tgt)
    params = list(model.parameters())
    values = [p.detach().clone() for p in params]
    keys = list(model.state_dict())
    hooks = _hook_count(model)
    modules = list(model.modules())
    reason = REFUSED.get((family, _key(name, options)))
    if reason is not None:
        with pytest.raises(InterventionError, match=reason):
            apply(model, name, **options)
        assert _hook_count(model) == hooks and list(model.state_dict()) == keys
        return

    handle = apply(model, name, **options)
    assert active_interventions(model) == {name: handle}
    with torch.no_grad():
        changed = zoo.forward_logits(model, idx)
    if name == "z_loss":  # forward unchanged, gradients changed
        assert torch.equal(changed, base)
        assert any(not torch.allclose(a, b) for a, b in zip(_grads(model, idx, tgt), base_grads, strict=True))
    else:
        assert (changed - base).abs().max() > 1e-4, "the intervention did not change the output"
    # new parameters are part of the model, and existing ones kept their identity
    model_params = {id(p) for p in model.parameters()}
    assert all(id(p) in model_params for p in handle.new_parameters())
    dropped = {id(m.bias) for m in modules if isinstance(m, nn.LayerNorm) and m.bias is not None}
    dropped = dropped if name == "rmsnorm" else set()
    assert {id(p) for p in params} - model_params == dropped  # only LayerNorm biases leave (rmsnorm)

    handle.remove()
    handle.remove()  # twice is safe
    with torch.no_grad():
        after = zoo.forward_logits(model, idx)
    assert torch.equal(after, base)
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert all(torch.equal(p, v) for p, v in zip(model.parameters(), values, strict=True))
    assert list(model.state_dict()) == keys
    assert _hook_count(model) == hooks
    assert active_interventions(model) == {}
    assert all(torch.equal(a, b) for a, b in zip(_grads(model, idx, tgt), base_grads, strict=True))


@pytest.mark.parametrize("family", ["reference", "hf_gpt2_sdpa", "hf_llama_eager", "encoder_post"])
def test_all_together_and_state_dict_round_trip(family: str) -> None:
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    idx, _ = zoo.batch(2)
    base = zoo.forward_logits(model, idx)
    keys = list(model.state_dict())
    specs: list = ["qk_norm", ("attn_softcap", {"cap": 0.5}), ("logit_softcap", {"cap": 0.5}), "z_loss"]
    specs.append(("norm_placement", {"to": "sandwich"}))
    if family != "hf_llama_eager":
        specs.append("rmsnorm")
    handle = apply(model, list(reversed(specs)))
    assert sorted(handle.names) == sorted(s if isinstance(s, str) else s[0] for s in specs)
    with torch.no_grad():
        for p in handle.new_parameters():
            p.uniform_(0.5, 1.5)  # non-trivial gains, so the round trip is meaningful
    out = zoo.forward_logits(model, idx)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    torch.manual_seed(1)
    twin = FAMILIES[family]().eval()
    twin_handle = apply(twin, specs)
    assert list(twin.state_dict()) == list(state)
    twin.load_state_dict(state)
    torch.testing.assert_close(zoo.forward_logits(twin, idx), out, rtol=0, atol=0)
    twin_handle.remove()

    handle.remove()
    assert torch.equal(zoo.forward_logits(model, idx), base)
    assert list(model.state_dict()) == keys
