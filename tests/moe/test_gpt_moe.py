"""The reference GPT's MoE preset: discovery finds its routers without hints; its forward equals a
hand-written mixture (every token through its k experts, weighed by the renormalised top-k softmax);
a capacity factor drops exactly the slots past each expert's capacity (first choices first); bad
settings are refused naming the field; the preset is a model spec and a recipe's [model] fields."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import stabkit
from stabkit.harness.models import GPT, GPTConfig, preset_config
from stabkit.harness.models.moe import MoE, capacity_mask
from stabkit.harness.models.spec import parse_model_spec


def test_discovery_finds_the_preset_s_routers_without_hints() -> None:
    torch.manual_seed(0)
    model = GPT(preset_config("tiny-moe"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = stabkit.inspect_model(model, example=torch.randint(0, 256, (2, 16))).moe
    assert [m.path for m in found] == ["blocks.0.mlp", "blocks.1.mlp"]
    for i, m in enumerate(found):
        assert (m.router, m.gate_weight, m.experts) == (
            f"blocks.{i}.mlp.router",
            f"blocks.{i}.mlp.router.gate.weight",
            f"blocks.{i}.mlp.experts",
        )
        assert (m.n_experts, m.top_k, m.scoring, m.score_bias, m.grouped) == (8, 2, "softmax", None, False)
        assert m.logits is not None and m.logits.key == 0 and m.indices is not None and m.indices.key == 2


def hand_mixture(moe: MoE, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    probs = F.linear(flat, moe.router.gate.weight).softmax(-1)
    w, idx = probs.topk(moe.router.top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for s in range(idx.shape[1]):
            if keep is None or keep[t, s]:
                out[t] += w[t, s] * moe.experts[int(idx[t, s])](flat[t])
    return out.reshape(x.shape)


def test_the_mixture_equals_a_hand_written_one() -> None:
    torch.manual_seed(1)
    moe = MoE(GPTConfig(d_model=16, n_heads=2, n_experts=4, top_k=2))
    x = torch.randn(2, 5, 16)
    torch.testing.assert_close(moe(x), hand_mixture(moe, x))


def test_capacity_keeps_first_choices_first_then_token_order() -> None:
    # 4 tokens, top-2 of 4 experts, factor 0.5: capacity ceil(0.5·4·2/4) = 1 slot per expert
    idx = torch.tensor([[0, 1], [0, 2], [1, 0], [3, 0]])
    keep = capacity_mask(idx, 4, 0.5)
    # slot 0: token 0 -> e0 (kept), token 1 -> e0 (full), token 2 -> e1 (kept), token 3 -> e3 (kept);
    # slot 1: token 0 -> e1 (full), token 1 -> e2 (kept), tokens 2, 3 -> e0 (full)
    assert keep.tolist() == [[True, False], [False, True], [True, False], [True, False]]


def test_a_capacity_factor_drops_the_slots_past_capacity() -> None:
    torch.manual_seed(2)
    moe = MoE(GPTConfig(d_model=16, n_heads=2, n_experts=4, top_k=2, capacity_factor=0.5))
    with torch.no_grad():
        moe.router.gate.weight[0] += 3.0  # most tokens want expert 0
    x = torch.randn(1, 8, 16).abs()
    flat = x.reshape(-1, 16)
    idx = F.linear(flat, moe.router.gate.weight).softmax(-1).topk(2, dim=-1).indices
    keep = capacity_mask(idx, 4, 0.5)
    per_expert = [int(((idx == e) & keep).sum()) for e in range(4)]
    assert max(per_expert) <= math.ceil(0.5 * 8 * 2 / 4) and int((~keep).sum()) > 0
    torch.testing.assert_close(moe(x), hand_mixture(moe, x, keep))


@pytest.mark.parametrize(
    ("field", "value"),
    [("n_experts", 1), ("top_k", 8), ("top_k", 0), ("capacity_factor", 0.0), ("expert_d_ff", 0)],
)
def test_bad_moe_settings_are_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"GPTConfig\.{field} must be"):
        GPTConfig(**{"n_experts": 8, field: value})  # type: ignore[arg-type]


def test_the_preset_is_a_model_spec() -> None:
    spec = parse_model_spec("tiny-moe")
    assert spec.is_reference and spec.target == "tiny-moe"
    cfg = preset_config("tiny-moe")
    assert (cfg.d_model, cfg.n_layers, cfg.n_experts, cfg.top_k, cfg.capacity_factor) == (64, 2, 8, 2, None)
