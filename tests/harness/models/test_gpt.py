"""The reference GPT computes what its config says, checked against hand-written maths."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from stabkit.harness.models import GPT, GPTConfig, preset_config
from stabkit.harness.models.layers import apply_rope, rope_tables


def hand_attention(
    attn: torch.nn.Module, x: torch.Tensor, n_heads: int, n_kv: int, cap: float | None = None
) -> torch.Tensor:
    """Causal attention written out: projections, repeated kv heads, softmax(q kᵀ/√d), output projection."""
    b, t, d = x.shape
    hd = d // n_heads
    q = (x @ attn.q_proj.weight.T).view(b, t, n_heads, hd).transpose(1, 2)
    k = (x @ attn.k_proj.weight.T).view(b, t, n_kv, hd).transpose(1, 2).repeat_interleave(n_heads // n_kv, 1)
    v = (x @ attn.v_proj.weight.T).view(b, t, n_kv, hd).transpose(1, 2).repeat_interleave(n_heads // n_kv, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    if cap is not None:
        scores = cap * torch.tanh(scores / cap)
    scores = scores.masked_fill(torch.ones(t, t).triu(1).bool(), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
    return y @ attn.o_proj.weight.T


@pytest.mark.parametrize("n_kv", [4, 2, 1])
def test_attention_matches_hand_computation_for_mha_gqa_mqa(n_kv: int) -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=32, n_heads=4, n_kv_heads=n_kv, context=8))
    x = torch.randn(2, 8, 32)
    attn = model.blocks[0].attn
    torch.testing.assert_close(attn(x), hand_attention(attn, x, 4, n_kv), rtol=1e-5, atol=1e-5)


def test_attention_softcap_path_matches_hand_computation_and_bounds() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(d_model=32, n_heads=4, context=8, attn_softcap=2.0, init_std=1.0))
    x = torch.randn(2, 8, 32)
    attn = model.blocks[0].attn
    torch.testing.assert_close(attn(x), hand_attention(attn, x, 4, 4, cap=2.0), rtol=1e-5, atol=1e-5)


def test_logit_softcap_bounds_the_output() -> None:
    torch.manual_seed(0)
    capped = GPT(GPTConfig(logit_softcap=3.0, init_std=2.0))
    idx = torch.randint(0, 256, (2, 16))
    logits = capped(idx)
    assert logits.abs().max() <= 3.0
    raw = GPT(GPTConfig(init_std=2.0))
    raw.load_state_dict(capped.state_dict())
    torch.testing.assert_close(logits, 3.0 * torch.tanh(raw(idx) / 3.0))


def test_rope_rotates_so_dot_products_depend_on_relative_position() -> None:
    cos, sin = rope_tables(8, 16, 10000.0)
    q, k = torch.randn(8), torch.randn(8)

    def rotated(vec: torch.Tensor, pos: int) -> torch.Tensor:
        seq = torch.zeros(1, 1, 16, 8)
        seq[0, 0, pos] = vec
        return apply_rope(seq, cos, sin)[0, 0, pos]

    assert rotated(q, 5).norm().item() == pytest.approx(q.norm().item(), rel=1e-5)
    d1 = rotated(q, 7) @ rotated(k, 3)
    d2 = rotated(q, 12) @ rotated(k, 8)
    assert d1.item() == pytest.approx(d2.item(), rel=1e-4)


def test_block_wiring_per_placement() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32)
    for placement in ("pre", "post", "sandwich"):
        model = GPT(GPTConfig(d_model=32, n_heads=4, context=8, norm_placement=placement, norm="rmsnorm"))
        blk = model.blocks[0]
        if placement == "pre":
            h = x + blk.attn(blk.norm1(x))
            want = h + blk.mlp(blk.norm2(h))
        elif placement == "post":
            h = blk.norm1(x + blk.attn(x))
            want = blk.norm2(h + blk.mlp(h))
        else:
            h = x + blk.post_norm1(blk.attn(blk.norm1(x)))
            want = h + blk.post_norm2(blk.mlp(blk.norm2(h)))
        torch.testing.assert_close(blk(x), want)


def test_swiglu_mlp_and_width() -> None:
    cfg = GPTConfig(d_model=48, n_heads=4, mlp="swiglu")
    assert cfg.ff_width == 128  # 8/3 * 48 = 128
    mlp = GPT(cfg).blocks[0].mlp
    x = torch.randn(3, 48)
    torch.testing.assert_close(mlp(x), mlp.proj(F.silu(mlp.gate(x)) * mlp.fc(x)))


def test_tiny_preset_is_the_cpu_proxy_size() -> None:
    cfg = preset_config("tiny")
    d, layers = cfg.d_model, cfg.n_layers
    per_block = 4 * d * d + 2 * d * 4 * d + 2 * d  # attention, MLP, two bias-free LayerNorm gains
    assert GPT(cfg).num_parameters() == layers * per_block + d
    assert 90_000 < GPT(cfg).num_parameters() < 110_000


def test_large_presets_build_on_meta() -> None:
    with torch.device("meta"):
        big = GPT(preset_config("1b"))
    assert 0.8e9 < big.num_parameters(non_embedding=False) < 1.2e9


def test_config_rejects_bad_values_with_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="must divide d_model"):
        GPTConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match=r"norm_placement must be one of \('pre', 'post', 'sandwich'\)"):
        GPTConfig(norm_placement="middle")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n_kv_heads=3"):
        GPTConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ValueError, match="unknown GPTConfig field"):
        GPTConfig().updated(width=3)
    with pytest.raises(ValueError, match="unknown model preset"):
        preset_config("huge")
    with pytest.raises(ValueError, match="exceeds the model's context"):
        GPT(GPTConfig(context=8))(torch.zeros(1, 9, dtype=torch.long))
