"""Transformer Engine's ``DotProductAttention`` measured exactly (issue 38, item 2).

The stand-in (`tests/standins/packages/transformer_engine`) mirrors TE main (2.20.0.dev0, d0067d0d) and
2.2–2.9 where it matters here: no ``softmax_scale`` on the module (the scale lives in its
``flash_attention`` / ``fused_attention`` / ``unfused_attention`` backends), the packed ``qkv_layer=`` /
``query_layer=None`` call ``MultiheadAttention`` makes (``transformer_engine/pytorch/attention/
multi_head_attention.py``: ``self.core_attention(None, None, None, ..., qkv_layer=mixed_x_layer,
qkv_interleave_dim=split_dim)``), TE's own window conversion (``check_set_window_size``) and padding
given as ``cu_seqlens``. Every expectation is built here by hand: the allowed (row, query, key) entries by
explicit loops over each row's actual lengths, then the float64 reference of `tests/standins/reference.py`.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from standins import installed
from standins.reference import reference_stats

from stabkit.attention import kernels

from .test_kernels import Measure, check, randn

torch.set_num_threads(1)
H, KV, D = 4, 2, 8


def _te() -> Any:
    from transformer_engine.pytorch import DotProductAttention

    return DotProductAttention


def _run(attn: Any, *args: Any, **kw: Any) -> Measure:
    with kernels.install(), Measure() as m:
        attn(*args, **kw)
    assert [c.kernel for c in m.calls] == ["transformer_engine"]
    return m


def _allowed(
    len_q: list[int], len_k: list[int], n_q: int, n_k: int, *, causal: bool, bottom: bool, window: tuple
) -> torch.Tensor:
    """(B, 1, L, S) bool by hand: row b has queries [0, len_q[b]) and keys [0, len_k[b]); query i sits
    at key position i + (len_k[b] - len_q[b]) when bottom-right aligned, at i otherwise."""
    out = torch.zeros(len(len_q), 1, n_q, n_k, dtype=torch.bool)
    for b, (lq, lk) in enumerate(zip(len_q, len_k, strict=True)):
        for i in range(lq):
            p = i + (lk - lq if bottom else 0)
            for j in range(lk):
                ok = not (causal and j > p)
                ok = ok and not (window[0] >= 0 and j < p - window[0])
                ok = ok and not (window[1] >= 0 and j > p + window[1])
                out[b, 0, i, j] = ok
    return out


def test_the_scale_is_read_from_the_backends_the_module_keeps_none() -> None:
    with installed():
        attn = _te()(H, D, num_gqa_groups=KV, qkv_format="bshd", attn_mask_type="no_mask", softmax_scale=0.37)
        assert not hasattr(attn, "softmax_scale")  # as upstream: only the backends hold it
        assert attn.unfused_attention.softmax_scale == 0.37
        q, k, v = randn(2, 6, H, D, scale=2), randn(2, 6, KV, D, scale=2), randn(2, 6, KV, D)
        m = _run(attn, q, k, v)
    (got,) = m.stats
    qh, kh = q.transpose(1, 2).double(), k.transpose(1, 2).repeat_interleave(H // KV, 1).double()
    by_hand = (qh @ kh.transpose(-1, -2) * 0.37).abs().amax(dim=(0, 2, 3))  # (H,)
    torch.testing.assert_close(got.max_logit.double(), by_hand, rtol=1e-5, atol=1e-6)
    check(got, reference_stats(q.transpose(1, 2), k.transpose(1, 2), scale=0.37))


@pytest.mark.parametrize(("fmt", "dim"), [("sbhd", -3), ("sbhd", -2), ("bshd", -3)])
def test_packed_qkv_layer_with_no_query_layer_as_multihead_attention_calls_it(fmt: str, dim: int) -> None:
    s, b = 7, 2
    with installed():
        attn = _te()(H, D, qkv_format=fmt, attn_mask_type="causal", softmax_scale=0.5)
        lead = (s, b) if fmt == "sbhd" else (b, s)
        shape = (*lead, 3, H, D) if dim == -3 else (*lead, H, 3, D)
        qkv = randn(*shape, scale=2)
        m = _run(attn, None, None, None, qkv_format=fmt, qkv_layer=qkv, qkv_interleave_dim=dim)
    q, k = qkv.select(dim, 0), qkv.select(dim, 1)
    if fmt == "sbhd":
        q, k = q.transpose(0, 1), k.transpose(0, 1)
    check(m.stats[0], reference_stats(q.transpose(1, 2), k.transpose(1, 2), scale=0.5, causal=True))


def test_packed_kv_layer_with_a_query_layer() -> None:
    with installed():
        attn = _te()(
            H, D, num_gqa_groups=KV, qkv_format="bshd", attn_mask_type="no_mask", attention_type="cross"
        )
        q, kv = randn(2, 5, H, D, scale=2), randn(2, 9, 2, KV, D, scale=2)
        m = _run(attn, q, None, None, kv_layer=kv)
    want = reference_stats(q.transpose(1, 2), kv[:, :, 0].transpose(1, 2))
    check(m.stats[0], want)


@pytest.mark.parametrize("call_type", ["no_mask", "padding"])
def test_a_non_causal_mask_type_at_the_call_drops_the_causal_window_as_te_does(call_type: str) -> None:
    # built causal: its window is (-1, 0); called with a non-causal type, TE's check_set_window_size
    # turns (-1, 0) into (-1, -1): every key is seen (padding: every key of the row's actual length)
    b, s = 2, 8
    with installed():
        attn = _te()(H, D, num_gqa_groups=KV, qkv_format="bshd", attn_mask_type="causal")
        assert attn.window_size == (-1, 0)
        q, k, v = randn(b, s, H, D, scale=2), randn(b, s, KV, D, scale=2), randn(b, s, KV, D)
        kw: dict[str, Any] = {"attn_mask_type": call_type}
        lengths = [s, s]
        if call_type == "padding":
            lengths = [s, 5]
            kw["cu_seqlens_q"] = kw["cu_seqlens_kv"] = torch.tensor([0, s, s + 5], dtype=torch.int32)
        with pytest.warns(UserWarning, match="window_size should be"):
            m = _run(attn, q, k, v, **kw)
    allowed = _allowed(lengths, lengths, s, s, causal=False, bottom=True, window=(-1, -1))
    assert allowed[0, 0, 0, s - 1]  # the first query sees the last key
    check(m.stats[0], reference_stats(q.transpose(1, 2), k.transpose(1, 2), attn_mask=allowed))


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize(
    ("mask_type", "window"),
    [
        ("padding_causal_bottom_right", None),  # bottom-right by each row's actual lengths
        ("padding_causal", (2, 0)),  # top-left, windowed
        ("padding", (1, 2)),  # bottom-right by actual lengths, two-sided window
    ],
)
def test_padding_given_as_cu_seqlens_with_actual_lengths(fmt: str, mask_type: str, window: Any) -> None:
    b, n_q, n_k = 3, 6, 9
    len_q, len_k = [6, 3, 4], [9, 7, 4]
    with installed():
        attn = _te()(
            H, D, num_gqa_groups=KV, qkv_format=fmt, attn_mask_type=mask_type, attention_type="cross"
        )
        shape = (lambda n, h: (n, b, h, D)) if fmt == "sbhd" else (lambda n, h: (b, n, h, D))
        q, k, v = randn(*shape(n_q, H), scale=2), randn(*shape(n_k, KV), scale=2), randn(*shape(n_k, KV))
        cu_q = torch.tensor([0, *torch.tensor(len_q).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(len_k).cumsum(0).tolist()], dtype=torch.int32)
        kw = {"cu_seqlens_q": cu_q, "cu_seqlens_kv": cu_k, "window_size": window}
        m = _run(attn, q, k, v, **kw)
    bottom = mask_type != "padding_causal"
    win = window if window is not None else (-1, 0)
    allowed = _allowed(len_q, len_k, n_q, n_k, causal="causal" in mask_type, bottom=bottom, window=win)
    qh = q.permute(1, 2, 0, 3) if fmt == "sbhd" else q.transpose(1, 2)
    kh = k.permute(1, 2, 0, 3) if fmt == "sbhd" else k.transpose(1, 2)
    want = reference_stats(qh, kh, attn_mask=allowed)
    check(m.stats[0], want)
    # with padded lengths the bottom-right offset would be 3 for every row: row 1 (3 queries, 7 keys)
    # would let its last query see keys 0..5 instead of 0..6
    if mask_type == "padding_causal_bottom_right":
        assert allowed[1, 0, 2, 6] and not allowed[1, 0, 2, 7]


def test_thd_with_gaps_between_sequences() -> None:
    # two sequences of 3 and 4 tokens, each padded to 4 / 5 slots: cu_seqlens [0, 3, 7], padded [0, 4, 9]
    with installed():
        attn = _te()(H, D, num_gqa_groups=KV, qkv_format="thd", attn_mask_type="padding_causal")
        q, k, v = randn(9, H, D, scale=2), randn(9, KV, D, scale=2), randn(9, KV, D)
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        padded = torch.tensor([0, 4, 9], dtype=torch.int32)
        kw = {
            "cu_seqlens_q_padded": padded,
            "cu_seqlens_kv_padded": padded,
            "max_seqlen_q": 5,
            "max_seqlen_kv": 5,
        }
        m = _run(attn, q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, **kw)
    allowed = torch.zeros(1, 1, 9, 9, dtype=torch.bool)
    for start, length in ((0, 3), (4, 4)):  # slots 3 and 8 are gaps
        for i in range(length):
            allowed[0, 0, start + i, start : start + i + 1] = True
    want = reference_stats(q.transpose(0, 1)[None], k.transpose(0, 1)[None], attn_mask=allowed)
    check(m.stats[0], want)
    assert int(want["rows"][0]) == 7


def test_te_2_2_keeps_the_class_in_attention_py() -> None:
    # TE <= 2.2: transformer_engine/pytorch/attention.py defines DotProductAttention; the 2.3+ module
    # path does not exist. Hide it while the entry points are wrapped: the class is found by the old path.
    new = "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention"
    with installed():
        attn = _te()(H, D, qkv_format="bshd", attn_mask_type="causal")
        q, k, v = randn(1, 5, H, D, scale=2), randn(1, 5, H, D, scale=2), randn(1, 5, H, D)
        hidden = sys.modules.pop(new)
        try:
            m = _run(attn, q, k, v)
        finally:
            sys.modules[new] = hidden
    check(m.stats[0], reference_stats(q.transpose(1, 2), k.transpose(1, 2), causal=True))
