"""Reading one intercepted attention call: SDPA argument variants, MHA variants, eager softmax, sampling.

Each case runs the probe's reader on the call's arguments and compares the statistics with a
float64 reference built here from the same tensors (explicit masks, explicit repeat of kv heads).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from stabkit.attention.measure.measure import measure
from stabkit.attention.measure.stats import HeadStats, Sampling
from stabkit.attention.readers import read_mha, read_sdpa, read_softmax

G = torch.Generator().manual_seed(0)


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=G) * scale


def reference(logits: torch.Tensor, allowed: torch.Tensor, bias: torch.Tensor | None = None) -> tuple:
    """(per-head max |logit| over allowed, per-head mean row entropy over rows with an allowed key)."""
    logits = logits.double()
    allowed = allowed.expand_as(logits)
    z = logits + (0 if bias is None else bias.double())
    p = torch.softmax(z.masked_fill(~allowed, -math.inf), dim=-1)
    row_h = -torch.where(allowed, p * torch.log(p.clamp_min(1e-300)), 0.0).sum(-1)  # (B, H, L)
    rows = allowed.any(-1)
    head_h = (row_h * rows).sum((0, 2)) / rows.sum((0, 2))
    return logits.abs().masked_fill(~allowed, 0).amax((0, 2, 3)), head_h


def check(got: HeadStats, want: tuple) -> None:
    torch.testing.assert_close(got.max_logit.double(), want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.head_entropy().double(), want[1], rtol=1e-5, atol=1e-6)


B, H, L, S, D = 3, 4, 7, 9, 8


def test_sdpa_bool_mask_custom_scale_matches_reference() -> None:
    q, k, v = randn(B, H, L, D, scale=2), randn(B, H, S, D, scale=2), randn(B, H, S, D)
    mask = torch.rand(B, 1, L, S, generator=G) > 0.4
    mask[0, 0, 2] = False  # one fully masked query row: left out
    got = measure(read_sdpa((q, k, v), {"attn_mask": mask, "scale": 0.3}))
    check(got, reference(q @ k.transpose(-1, -2) * 0.3, mask))


def test_sdpa_additive_mask_enters_entropy_not_max() -> None:
    q, k, v = randn(B, H, L, D), randn(B, H, S, D), randn(B, H, S, D)
    bias = randn(1, H, L, S)  # e.g. a relative-position bias
    bias[..., -2:] = -math.inf  # and the last two keys masked
    got = measure(read_sdpa((q, k, v, bias), {}))
    allowed = torch.isfinite(bias)
    want = reference(q @ k.transpose(-1, -2) / math.sqrt(D), allowed, bias.masked_fill(~allowed, 0))
    check(got, want)


def test_sdpa_finfo_min_additive_mask_counts_as_masked() -> None:
    q, k, v = randn(1, H, L, L), randn(1, H, L, L), randn(1, H, L, L)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    additive = torch.zeros(L, L).masked_fill(~causal, torch.finfo(torch.float32).min)
    got = measure(read_sdpa((q, k, v), {"attn_mask": additive}))
    check(got, reference(q @ k.transpose(-1, -2) / math.sqrt(L), causal))


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_sdpa_gqa_and_causal(kv_heads: int) -> None:
    q, k, v = randn(B, H, L, D), randn(B, kv_heads, L, D), randn(B, kv_heads, L, D)
    got = measure(read_sdpa((q, k, v), {"is_causal": True, "enable_gqa": True}))
    k_rep = k.repeat_interleave(H // kv_heads, dim=1)
    check(
        got, reference(q @ k_rep.transpose(-1, -2) / math.sqrt(D), torch.ones(L, L, dtype=torch.bool).tril())
    )


def test_sdpa_three_dim_inputs_are_one_head() -> None:
    q, k, v = randn(B, L, D), randn(B, L, D), randn(B, L, D)
    got = measure(read_sdpa((q, k, v, None, 0.0, True), {}))
    logits = (q @ k.transpose(-1, -2) / math.sqrt(D))[:, None]
    check(got, reference(logits, torch.ones(L, L, dtype=torch.bool).tril()))


def test_sampled_entropy_is_that_of_the_chosen_rows_and_positions_and_max_is_bounded() -> None:
    T = 20
    q, k, v = randn(6, H, T, D), randn(6, H, T, D), randn(6, H, T, D)
    sampling = Sampling(rows=2, queries=5, round=3)
    rows, queries = sampling.row_slice(6), sampling.query_slice(T)
    positions = torch.arange(T)[queries]
    assert len(range(6)[rows]) == 2 and 1 <= len(positions) <= 5
    assert positions.diff().unique().numel() == 1  # evenly strided
    got = measure(read_sdpa((q, k, v), {"is_causal": True}), sampling)
    full = q @ k.transpose(-1, -2) / math.sqrt(D)
    allowed = torch.ones(T, T, dtype=torch.bool).tril()
    sub_max, sub_entropy = reference(full[rows][:, :, positions], allowed[positions])
    exact_max, _ = reference(full, allowed)
    torch.testing.assert_close(got.head_entropy().double(), sub_entropy, rtol=1e-5, atol=1e-6)
    assert (got.max_logit.double() >= sub_max - 1e-5).all()  # at least the uniform sample's max
    assert (got.max_logit.double() <= exact_max + 1e-5).all()  # never above the exact max


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("masking", ["causal", "bool", "padding"])
def test_max_candidates_find_a_large_norm_query_the_uniform_sample_misses(
    kv_heads: int, masking: str
) -> None:
    T = 24
    q, k, v = randn(8, H, T, D), randn(8, kv_heads, T, D), randn(8, kv_heads, T, D)
    q[6, :, 17] *= 10  # one outlier query (row 6, position 17) in every head
    kwargs: dict = {"is_causal": True, "enable_gqa": True}
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    if masking != "causal":
        pad = torch.ones(8, 1, 1, T, dtype=torch.bool)
        pad[6, ..., 10:] = False  # row 6 may only see its first 10 keys
        allowed = allowed & pad if masking == "padding" else pad
        kwargs = {"attn_mask": allowed, "enable_gqa": True}
    sampling = Sampling(rows=2, queries=4, round=0)  # rows 0-1: not row 6
    assert 6 not in range(8)[sampling.row_slice(8)]
    got = measure(read_sdpa((q, k, v), kwargs), sampling)
    full = q @ k.repeat_interleave(H // kv_heads, dim=1).transpose(-1, -2) / math.sqrt(D)
    exact_max, _ = reference(full, allowed)
    torch.testing.assert_close(got.max_logit.double(), exact_max, rtol=1e-5, atol=1e-6)


def test_eager_softmax_max_covers_all_rows_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import stabkit.attention.measure.measure as am

    monkeypatch.setattr(am, "CHUNK_ELEMENTS", 3 * H * L * L)  # several chunks
    logits = randn(8, H, L, L)
    logits[7, 2, 5, 1] = -40.0  # the largest magnitude, outside the uniform sample
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    x = logits.masked_fill(~causal, torch.finfo(torch.float32).min)
    got = measure(read_softmax((x, -1), {}), Sampling(rows=2, queries=3))
    torch.testing.assert_close(got.max_logit.double(), reference(logits, causal)[0], rtol=1e-6, atol=1e-6)
    assert got.max_logit[2] == 40.0


def test_sampling_rotates_and_stays_in_range() -> None:
    seen_rows, seen_offsets = set(), set()
    for r in range(12):
        s = Sampling(rows=3, queries=4, round=r)
        rs, qs = s.row_slice(8), s.query_slice(16)
        assert rs.start >= 0 and rs.stop <= 8 and rs.stop - rs.start == 3
        assert len(range(16)[qs]) <= 4
        seen_rows.add(rs.start)
        seen_offsets.add(qs.start)
    assert len(seen_rows) > 1 and len(seen_offsets) > 1
    assert Sampling(None, None).row_slice(5) == slice(None) and Sampling(8, 64).query_slice(10) == slice(None)


def test_eager_softmax_input_with_finfo_min_mask() -> None:
    logits = randn(B, H, L, L, scale=3)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    x = logits + torch.zeros(L, L).masked_fill(~causal, torch.finfo(torch.float32).min)
    check(measure(read_softmax((x,), {"dim": -1})), reference(logits, causal))
    with pytest.raises(ValueError, match="dim=1"):
        read_softmax((x, 1), {})
    with pytest.raises(ValueError, match="expected"):
        read_softmax((randn(L, L),), {"dim": -1})


def mha_reference(mha: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """(B, H, L, S) logits from batch-first query/key and the module's weights."""
    E, h = mha.embed_dim, mha.num_heads
    if mha.in_proj_weight is not None:
        w_q, w_k = mha.in_proj_weight[:E], mha.in_proj_weight[E : 2 * E]
    else:
        w_q, w_k = mha.q_proj_weight, mha.k_proj_weight
    b = mha.in_proj_bias
    q = F.linear(query, w_q, b[:E]).view(query.shape[0], query.shape[1], h, -1).transpose(1, 2)
    k = F.linear(key, w_k, b[E : 2 * E]).view(key.shape[0], key.shape[1], h, -1).transpose(1, 2)
    return q @ k.transpose(-1, -2) / math.sqrt(E // h)


def call_mha(mha: nn.MultiheadAttention, *args: object, **kwargs: object) -> list[tuple]:
    """Run the module, capturing the F.multi_head_attention_forward call it makes."""
    from torch.overrides import TorchFunctionMode

    calls: list[tuple] = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, a=(), kw=None):  # type: ignore[no-untyped-def]
            kw = kw or {}
            if func is F.multi_head_attention_forward:
                calls.append((func, a, kw))
            return func(*a, **kw)

    with Spy():
        mha(*args, **kwargs)
    return calls


def test_mha_kdim_bool_attn_mask_and_key_padding() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, kdim=12, vdim=12, batch_first=True).train()
    query, key = randn(B, L, 16), randn(B, S, 12)
    blocked = torch.rand(L, S, generator=G) > 0.7  # True = may NOT attend
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, -3:] = True  # padding
    (call,) = call_mha(mha, query, key, key, attn_mask=blocked, key_padding_mask=kpm, need_weights=False)
    got = measure(read_mha(*call[1:]))
    allowed = ~blocked[None, None] & ~kpm[:, None, None, :]
    check(got, reference(mha_reference(mha, query, key), allowed))


def test_mha_per_head_additive_mask_unbatched_and_causal_hint() -> None:
    torch.manual_seed(1)
    mha = nn.MultiheadAttention(16, 4, batch_first=False).train()
    x = randn(L, 1, 16)
    per_head = torch.rand(H, L, L, generator=G) > 0.6
    per_head[:, :, 0] = False  # every query may see key 0
    additive = torch.zeros(H, L, L).masked_fill(per_head, -math.inf)
    (call,) = call_mha(mha, x, x, x, attn_mask=additive, need_weights=False)
    got = measure(read_mha(*call[1:]))
    check(got, reference(mha_reference(mha, x.transpose(0, 1), x.transpose(0, 1)), ~per_head[None]))
    # unbatched (L, E) input with the causal hint: MHA runs SDPA causally and ignores the mask's values
    garbage = torch.zeros(L, L)
    (call,) = call_mha(mha, x[:, 0], x[:, 0], x[:, 0], attn_mask=garbage, is_causal=True, need_weights=False)
    got = measure(read_mha(*call[1:]))
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    check(got, reference(mha_reference(mha, x.transpose(0, 1), x.transpose(0, 1)), causal))


def test_mha_unsupported_options_raise() -> None:
    mha = nn.MultiheadAttention(16, 4, add_bias_kv=True).train()
    x = randn(L, B, 16)
    (call,) = call_mha(mha, x, x, x)
    with pytest.raises(ValueError, match="bias_k"):
        read_mha(*call[1:])
