"""stabkit.attention: the math path against SDPA, and the scoped function mode's hook ordering."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stabkit.attention import SDPA, SDPAArgs, attach_scope, math_attention, softcap_score_mod


def _qkv(hq: int = 4, hkv: int = 4, L: int = 5, S: int = 5, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, L, 8, generator=g)
    k = torch.randn(2, hkv, S, 8, generator=g)
    v = torch.randn(2, hkv, S, 6, generator=g)
    return q, k, v


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"is_causal": True},
        {"scale": 0.7},
        {"is_causal": True, "scale": 0.2},
    ],
)
@pytest.mark.parametrize("shape", [(4, 4, 5, 5), (4, 2, 5, 5), (4, 4, 3, 7), (4, 4, 7, 3)])
def test_math_matches_sdpa(kwargs: dict, shape: tuple[int, int, int, int]) -> None:
    hq, hkv, L, S = shape
    q, k, v = _qkv(hq, hkv, L, S)
    gqa = hq != hkv
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa, **kwargs)
    got = math_attention(q, k, v, enable_gqa=gqa, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_math_masks_match_sdpa() -> None:
    q, k, v = _qkv(L=5, S=6)
    g = torch.Generator().manual_seed(3)
    bool_mask = torch.rand(2, 1, 5, 6, generator=g) > 0.3
    bool_mask[0, 0, 2] = False  # one fully masked row: SDPA's math gives zeros there
    additive = torch.randn(2, 4, 5, 6, generator=g)
    additive[1, :, :, 4] = float("-inf")
    for mask in (bool_mask, additive):
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        got = math_attention(q, k, v, attn_mask=mask)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(math_attention(q, k, v, attn_mask=bool_mask)[0, :, 2], torch.zeros(4, 6))


def test_math_three_dim_inputs_and_weights() -> None:
    q, k, v = (t[0] for t in _qkv())  # (H, L, E) treated as (N, L, E)
    out, weights = math_attention(q, k, v, is_causal=True, return_weights=True)
    torch.testing.assert_close(
        out, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-6
    )
    expected = torch.softmax(
        (q @ k.transpose(-2, -1) / 8**0.5).masked_fill(
            ~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf")
        ),
        -1,
    )
    torch.testing.assert_close(weights, expected)


def test_softcap_and_score_mod_are_applied_before_the_mask() -> None:
    q, k, v = _qkv()
    q = q * 10  # logits of tens: the cap matters
    cap = 2.0
    logits = (q @ k.transpose(-2, -1)) * 8**-0.5
    capped = (cap * torch.tanh(logits / cap)).masked_fill(
        ~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf")
    )
    want = torch.softmax(capped, -1) @ v
    torch.testing.assert_close(math_attention(q, k, v, is_causal=True, softcap=cap), want)
    torch.testing.assert_close(
        math_attention(q, k, v, is_causal=True, score_mod=softcap_score_mod(cap)), want
    )

    def bias_mod(score, b, h, q_idx, kv_idx):  # FlexAttention-style, uses the indices (ALiBi-like)
        return score - 0.5 * h * (q_idx - kv_idx).abs()

    heads = torch.arange(4).view(1, 4, 1, 1)
    dist = (torch.arange(5).view(5, 1) - torch.arange(5).view(1, 5)).abs()
    want = torch.softmax(logits - 0.5 * heads * dist, -1) @ v
    torch.testing.assert_close(math_attention(q, k, v, score_mod=bias_mod), want)


def test_dropout_applies_to_weights() -> None:
    q, k, v = _qkv()
    torch.manual_seed(5)
    got = math_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(5)
    weights = torch.softmax((q @ k.transpose(-2, -1)) * 8**-0.5, -1)
    torch.testing.assert_close(got, F.dropout(weights, 0.5) @ v)


def test_sdpa_args_binding() -> None:
    q, k, v = _qkv()
    a = SDPAArgs.from_call((q, k, v, None, 0.0, True), {"scale": 0.5})
    assert a.is_causal and a.scale == 0.5 and a.attn_mask is None and not a.enable_gqa
    torch.testing.assert_close(a.run(), F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5))
    with pytest.raises(TypeError, match="unexpected"):
        SDPAArgs.from_call((q, k, v), {"bogus": 1})
    with pytest.raises(ValueError, match="not both"):
        math_attention(q, k, v, attn_mask=torch.ones(5, 5, dtype=torch.bool), is_causal=True)


# ---------------------------------------------------------------- scope
class Attn(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attn()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outside = F.scaled_dot_product_attention(q, k, v)  # not in the attention module: never intercepted
        return self.attn(q, k, v) + 0 * outside


def test_scope_is_narrow_and_observer_is_innermost() -> None:
    net = Net()
    q, k, v = _qkv()
    seen: list[str] = []

    def changer(path, func, args, kwargs):
        seen.append("changer")
        return SDPAArgs.from_call(args, kwargs).run(softcap=1.0)

    def observer(path, func, args, kwargs):
        seen.append(f"observer:{path}")
        return func(*args, **kwargs)  # passes on, outwards to the changer

    exits: list[tuple[str, int]] = []
    # the observer is attached first and the changer second: the order must not matter
    obs = attach_scope(
        net, ["attn"], {SDPA: observer}, outer=False, on_exit=lambda p, n, o: exits.append((p, n))
    )
    chg = attach_scope(net, ["attn"], {SDPA: changer}, outer=True)
    depth = torch._C._len_torch_function_stack()
    out = net(q, k, v)
    assert seen == ["observer:attn", "changer"]
    assert exits == [("attn", 1)]
    assert torch._C._len_torch_function_stack() == depth
    torch.testing.assert_close(out, math_attention(q, k, v, is_causal=True, softcap=1.0))
    obs.remove()
    chg.remove()
    chg.remove()  # twice is safe
    torch.testing.assert_close(net(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_scope_pops_on_error_and_respects_enabled() -> None:
    net = Net()
    q, k, v = _qkv()
    calls: list[int] = []
    on = {"flag": False}

    def handler(path, func, args, kwargs):
        calls.append(1)
        return func(*args, **kwargs)

    with attach_scope(net, ["attn"], {SDPA: handler}, outer=False, enabled=lambda: on["flag"]):
        net(q, k, v)
        assert calls == []
        on["flag"] = True
        net(q, k, v)
        assert calls == [1]
        depth = torch._C._len_torch_function_stack()
        with pytest.raises(RuntimeError):
            net(q, k[..., :3], v)  # shape error inside the scoped forward
        assert torch._C._len_torch_function_stack() == depth
