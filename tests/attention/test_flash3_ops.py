"""flash-attn 3's C++ op ``flash_attn_3::fwd`` and its FP8 descale factors, measured exactly (issue 38, item 4).

``hopper/flash_api.cpp`` (Dao-AILab/flash-attention @ 0251105a) registers ``flash_attn_3::fwd`` with
schema names of its own (``q_v``, ``out``, ``is_causal``, ``is_rotary_interleaved``); FA3 builds from
May to July 2025 call it straight from Python, later ones from inside the ``flash_attn_3::_flash_attn_forward``
custom op (the stand-in does the same). FP8 calls pass ``q_descale`` / ``k_descale`` of shape
(batch, num_heads_k): the kernel's logit is ``(q·k) · q_descale · k_descale · softmax_scale``
(``flash_fwd_kernel_sm90.h``). Expectations: the float64 reference of `tests/standins/reference.py` on
queries and keys dequantised here by hand.
"""

from __future__ import annotations

import pytest
import torch
from standins import installed
from standins.reference import reference_stats

from stabkit.attention import kernels

from .test_kernels import Measure, check, randn

torch.set_num_threads(1)
H, KV, D = 4, 2, 16


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def test_the_fwd_op_called_directly_is_read_with_its_schema_names() -> None:
    q, k, v = randn(2, 5, H, D, scale=2), randn(2, 9, KV, D, scale=2), randn(2, 9, KV, D)
    with installed(), kernels.install(), Measure() as m:
        torch.ops.flash_attn_3.fwd(
            q, k, v, softmax_scale=0.4, is_causal=True, window_size_left=3, window_size_right=0
        )
    assert [c.kernel for c in m.calls] == ["flash_attn_3"]
    want = reference_stats(
        _bhsd(q), _bhsd(k), scale=0.4, causal=True, causal_align="bottom_right", window=(3, 0)
    )
    check(m.stats[0], want)


def test_the_fwd_op_packed() -> None:
    cu = torch.tensor([0, 4, 11], dtype=torch.int32)
    q, k, v = randn(11, H, D, scale=2), randn(11, KV, D, scale=2), randn(11, KV, D)
    with installed(), kernels.install(), Measure() as m:
        torch.ops.flash_attn_3.fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=7, max_seqlen_k=7,
                                   is_causal=True)  # fmt: skip
    packed = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    want = reference_stats(packed(q), packed(k), causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    check(m.stats[0], want)


def _fp8(*shape: int) -> torch.Tensor:
    return randn(*shape, scale=3).to(torch.float8_e4m3fn)


def _dequantised(x: torch.Tensor, descale: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, heads, T, D) float64 ``x`` (B, T, heads, D) times its (B, Hkv) descale, repeated per group."""
    per_head = descale.double().repeat_interleave(heads // descale.shape[1], dim=1)  # (B, heads)
    return _bhsd(x.double()) * per_head[:, :, None, None]


@pytest.mark.parametrize("entry", ["flash_attn_func", "fwd"])
def test_fp8_descales_enter_the_max_logit(entry: str) -> None:
    q, k, v = _fp8(2, 6, H, D), _fp8(2, 6, KV, D), _fp8(2, 6, KV, D)
    gen = torch.Generator().manual_seed(5)
    q_descale, k_descale = (
        torch.rand(2, KV, generator=gen) * 3 + 0.5,
        torch.rand(2, KV, generator=gen) * 3 + 0.5,
    )
    with installed(), kernels.install(), Measure() as m:
        if entry == "fwd":
            torch.ops.flash_attn_3.fwd(q, k, v, q_descale=q_descale, k_descale=k_descale, is_causal=True)
        else:
            import flash_attn_interface

            flash_attn_interface.flash_attn_func(
                q, k, v, causal=True, q_descale=q_descale, k_descale=k_descale
            )
    qd, kd = _dequantised(q, q_descale, H), _dequantised(k, k_descale, KV)
    want = reference_stats(qd, kd, causal=True)
    check(m.stats[0], want)
    raw = reference_stats(_bhsd(q.double()), _bhsd(k.double()), causal=True)["max_logit"]
    assert not torch.allclose(raw, want["max_logit"], rtol=0.05)  # the descales matter at this scale


def test_fp8_descales_per_document_when_packed() -> None:
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = _fp8(8, H, D), _fp8(8, KV, D), _fp8(8, KV, D)
    q_descale = torch.tensor([[0.5, 2.0], [3.0, 1.5]])  # (documents, Hkv)
    k_descale = torch.tensor([[1.0, 0.25], [2.0, 4.0]])
    with installed(), kernels.install(), Measure() as m:
        torch.ops.flash_attn_3.fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5,
                                   q_descale=q_descale, k_descale=k_descale, is_causal=True)  # fmt: skip
    doc = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    per_q = (q_descale[doc].repeat_interleave(H // KV, dim=1)).double()  # (T, H)
    per_k = k_descale[doc].double()  # (T, KV)
    qd = (q.double() * per_q[:, :, None]).transpose(0, 1)[None]
    kd = (k.double() * per_k[:, :, None]).transpose(0, 1)[None]
    want = reference_stats(qd, kd, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    check(m.stats[0], want)
