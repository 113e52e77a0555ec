"""logit_softcap and z_loss against independent references: the reference GPT built with the cap, the
closed form cap·tanh(x/cap), and autograd of the explicit z-loss term."""

from __future__ import annotations

import pytest
import torch
import zoo
from torch import nn

from stabkit.interventions import apply, z_loss


def test_logit_softcap_equals_config_built_and_bounds() -> None:
    torch.manual_seed(0)
    mine = zoo.reference_gpt(init_std=0.5)
    built = zoo.reference_gpt(logit_softcap=2.0)
    built.load_state_dict(mine.state_dict())
    idx, _ = zoo.batch(0)
    base = mine(idx)
    assert base.abs().max() > 2.0
    apply(mine, "logit_softcap", cap=2.0)
    capped = mine(idx)
    assert torch.equal(capped, built(idx))
    assert capped.abs().max() <= 2.0
    torch.testing.assert_close(capped, 2.0 * torch.tanh(base / 2.0))


def test_logit_softcap_hf_model_output() -> None:
    torch.manual_seed(0)
    model = zoo.hf_llama()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 3.0)
    idx, _ = zoo.batch(0)
    base = model(idx).logits
    apply(model, "logit_softcap", cap=1.5)
    out = model(idx).logits
    torch.testing.assert_close(out, 1.5 * torch.tanh(base / 1.5))
    assert out.abs().max() <= 1.5 < base.abs().max()


def test_explicit_z_loss_is_the_hand_formula() -> None:
    logits = torch.randn(3, 5, 11) * 4
    lse = torch.log(torch.exp(logits.double()).sum(-1))
    torch.testing.assert_close(z_loss(logits, 0.01).double(), 0.01 * (lse**2).mean(), rtol=1e-5, atol=1e-7)


def _param_grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize(
    "case", ["reference", "reference_capped_config", "reference_plus_logit_softcap", "hf_gpt2", "encoder"]
)
def test_implicit_z_loss_gradient_equals_explicit_term(case: str) -> None:
    coef = 0.05
    torch.manual_seed(0)
    build = {
        "reference": lambda: zoo.reference_gpt(init_std=0.3),
        "reference_capped_config": lambda: zoo.reference_gpt(init_std=0.3, logit_softcap=3.0),
        "reference_plus_logit_softcap": lambda: zoo.reference_gpt(init_std=0.3),
        "hf_gpt2": zoo.hf_gpt2,
        "encoder": zoo.EncoderLM,
    }[case]
    model = build()
    extra = [("logit_softcap", {"cap": 3.0})] if case == "reference_plus_logit_softcap" else []
    idx, tgt = zoo.batch(0)

    # explicit: loss + z_loss(final logits)
    if extra:
        apply(model, extra)
    logits = zoo.forward_logits(model, idx)
    (zoo.lm_loss(logits, tgt) + z_loss(logits, coef)).backward()
    want = _param_grads(model)
    want_value = z_loss(logits.detach(), coef)
    model.zero_grad(set_to_none=True)
    for handle in list(getattr(model, "_stabkit_interventions", {}).values()):
        handle.remove()

    # implicit: the user's loss only. z_loss applied *before* the cap, in its own call: the cap's hook
    # is prepended on the head, so the z-loss still sees the capped (final) logits
    handle = apply(model, "z_loss", coef=coef)
    if extra:
        apply(model, extra)
    logits = zoo.forward_logits(model, idx)
    zoo.lm_loss(logits, tgt).backward()
    got = _param_grads(model)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-7)
    metric = handle.metrics()["logits/z_loss"]
    assert metric.dim() == 0 and not metric.requires_grad and metric.device == logits.device
    torch.testing.assert_close(metric, want_value)


def test_z_loss_changes_no_gradient_in_no_grad_and_leaves_values() -> None:
    torch.manual_seed(0)
    model = zoo.reference_gpt()
    idx, _ = zoo.batch(0)
    base = model(idx)
    handle = apply(model, "z_loss")
    assert handle.metrics() == {}  # nothing measured before the first forward
    with torch.no_grad():
        out = model(idx)
    assert torch.equal(out, base)
    assert "logits/z_loss" in handle.metrics()
    handle.remove()
    assert handle.metrics() == {}
