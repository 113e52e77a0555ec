"""Known attention kernels, read at their entry points and measured exactly.

Each case calls a kernel's real Python API — pure-PyTorch stand-ins for flash-attn 2 and 3, xformers
and Transformer Engine (`tests/standins`), the real FlexAttention and aten ops — under a function mode
that does what the attention probe does (recognise the call by op name or wrapped entry point, read q
and k with the call's masks, measure), and compares the per-head max |logit| and entropy (and sink
mass) with the independent float64 reference that materialises the masked logits
(`tests/standins/reference.py`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from standins import installed
from standins.reference import reference_stats
from torch.overrides import TorchFunctionMode

from stabkit.attention import kernels
from stabkit.attention.measure.measure import measure
from stabkit.attention.measure.stats import HeadStats, Sampling

G = torch.Generator().manual_seed(0)


def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=G) * scale


class Measure(TorchFunctionMode):
    """Measures every known-kernel call made while active (exact, or on `sampling`)."""

    def __init__(self, sampling: Sampling | None = None) -> None:
        super().__init__()
        self.stats: list[HeadStats] = []
        self.calls: list[Any] = []
        self.sampling = sampling

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kernel = kernels.lookup(func)
        if kernel is not None:
            with torch.no_grad():
                call = kernels.read_call(kernel, func, args, kwargs)
                self.calls.append(call)
                if self.sampling is None:
                    self.stats.append(measure(call))
                else:
                    self.stats.append(measure(call, self.sampling))
        return func(*args, **kwargs)


@contextmanager
def measuring(sampling: Sampling | None = None) -> Iterator[Measure]:
    with installed(), kernels.install(), Measure(sampling) as m:
        yield m


def check(got: HeadStats, want: dict[str, torch.Tensor], sinks: bool = False) -> None:
    torch.testing.assert_close(got.max_logit.double(), want["max_logit"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.head_entropy().double(), want["entropy"], rtol=1e-5, atol=1e-6)
    if sinks:
        mass = got.sink_mass()
        assert mass is not None
        torch.testing.assert_close(mass.double(), want["sink_mass"], rtol=1e-5, atol=1e-6)


def bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


# ------------------------------------------------------------------------------------------ flash-attn 2
@pytest.mark.parametrize(
    ("n_q", "kv_heads", "masks"),
    [
        (12, 4, {"causal": True}),
        (12, 2, {"causal": True, "window_size": (3, 0)}),  # GQA + sliding window
        (5, 4, {"causal": True, "softcap": 2.0}),  # fewer queries: causal aligned bottom-right
        (12, 1, {"window_size": (2, 3)}),  # MQA, two-sided window
        (7, 4, {"causal": True, "alibi_slopes": "h"}),
        (7, 4, {"alibi_slopes": "bh"}),
    ],
)
def test_flash_attn_func(n_q: int, kv_heads: int, masks: dict) -> None:
    q, k, v = randn(2, n_q, 4, 8, scale=2), randn(2, 12, kv_heads, 8, scale=2), randn(2, 12, kv_heads, 8)
    masks = dict(masks)
    slopes = masks.pop("alibi_slopes", None)
    if slopes is not None:
        masks["alibi_slopes"] = torch.rand(4, generator=G) if slopes == "h" else torch.rand(2, 4, generator=G)
    with measuring() as m:
        from flash_attn import flash_attn_func

        flash_attn_func(q, k, v, softmax_scale=0.4, **masks)
    (got,) = m.stats
    window = masks.get("window_size", (-1, -1))
    if masks.get("causal"):
        window = (window[0], 0)
    want = reference_stats(
        bhsd(q),
        bhsd(k),
        scale=0.4,
        causal=bool(masks.get("causal")),
        causal_align="bottom_right",
        window=window,
        alibi_slopes=masks.get("alibi_slopes"),
        softcap=masks.get("softcap", 0.0),
    )
    check(got, want)


def test_flash_attn_packed_entry_points_are_the_same_op() -> None:
    qkv = randn(2, 10, 3, 4, 8)
    kv = qkv[:, :, 1:]
    with measuring() as m:
        from flash_attn import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func

        flash_attn_qkvpacked_func(qkv, causal=True)
        flash_attn_kvpacked_func(qkv[:, :, 0], kv, causal=True)
        flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True)
    assert len(m.stats) == 3 and {c.kernel for c in m.calls} == {"flash_attn"}
    want = reference_stats(bhsd(qkv[:, :, 0]), bhsd(qkv[:, :, 1]), causal=True, causal_align="bottom_right")
    for got in m.stats:
        check(got, want)


@pytest.mark.parametrize("masks", [{"causal": True}, {"causal": True, "window_size": (3, 0)}, {}])
def test_flash_attn_varlen_measures_each_document_apart(masks: dict) -> None:
    cu_q = torch.tensor([0, 5, 12, 20], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 12, 23], dtype=torch.int32)  # keys may outnumber queries per document
    q, k, v = randn(20, 4, 8, scale=2), randn(23, 2, 8, scale=2), randn(23, 2, 8)
    slopes = torch.rand(3, 4, generator=G)  # (documents, heads)
    with measuring() as m:
        from flash_attn import flash_attn_varlen_func

        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 8, 11, alibi_slopes=slopes, **masks)
    (got,) = m.stats
    window = masks.get("window_size", (-1, -1))
    want = reference_stats(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        causal=bool(masks.get("causal")),
        causal_align="bottom_right",
        window=(window[0], 0) if masks.get("causal") else window,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        alibi_slopes=slopes,
    )
    check(got, want)


def test_sampled_varlen_max_is_a_lower_bound_found_by_the_candidates() -> None:
    cu = torch.tensor([0, 9, 30], dtype=torch.int32)
    q, k, v = randn(30, 4, 8), randn(30, 4, 8), randn(30, 4, 8)
    q[20] *= 25  # one query of the second document far larger than the rest
    with measuring(Sampling(rows=1, queries=4)) as m:
        from flash_attn import flash_attn_varlen_func

        flash_attn_varlen_func(q, k, v, cu, cu, 21, 21, causal=True)
    (got,) = m.stats
    want = reference_stats(q.transpose(0, 1)[None], k.transpose(0, 1)[None], causal=True,
                           causal_align="bottom_right", cu_seqlens_q=cu, cu_seqlens_k=cu)  # fmt: skip
    assert bool((got.max_logit.double() <= want["max_logit"] * (1 + 1e-5)).all())  # float32 rounding
    torch.testing.assert_close(got.max_logit.double(), want["max_logit"], rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ flash-attn 3
@pytest.mark.parametrize(
    "masks",
    [{"causal": True}, {"causal": True, "attention_chunk": 4}, {"window_size": (2, 1), "softcap": 1.5}],
)
def test_flash_attn_3(masks: dict) -> None:
    q, k, v = randn(2, 9, 4, 8, scale=2), randn(2, 11, 2, 8, scale=2), randn(2, 11, 2, 8)
    with measuring() as m:
        from flash_attn_interface import flash_attn_func

        flash_attn_func(q, k, v, **masks)
    (got,) = m.stats
    assert m.calls[0].kernel == "flash_attn_3"
    window = masks.get("window_size", (-1, -1))
    want = reference_stats(
        bhsd(q),
        bhsd(k),
        causal=bool(masks.get("causal")),
        causal_align="bottom_right",
        window=(window[0], 0) if masks.get("causal") else window,
        chunk=masks.get("attention_chunk", 0),
        softcap=masks.get("softcap", 0.0),
    )
    check(got, want)


# ------------------------------------------------------------------------------------------ FlexAttention
def test_flex_attention_score_mod_and_document_block_mask() -> None:
    import torch.nn.attention.flex_attention as flex

    documents = torch.tensor([0] * 5 + [1] * 7 + [2] * 4)

    def doc_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (documents[q_idx] == documents[kv_idx]) & (q_idx >= kv_idx)

    bias = randn(4, 16)

    def score_mod(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return 3.0 * torch.tanh(score / 3.0) + bias[h, q_idx - kv_idx]

    q, k, v = randn(2, 4, 16, 8, scale=2), randn(2, 2, 16, 8, scale=2), randn(2, 2, 16, 8)
    block_mask = flex.create_block_mask(doc_causal, None, None, 16, 16, device="cpu", BLOCK_SIZE=4)
    with measuring() as m, torch.no_grad():  # (FlexAttention runs no gradient on a CPU)
        flex.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)
    (got,) = m.stats
    assert m.calls[0].kernel == "flex_attention"
    want = reference_stats(q, k, score_mod=score_mod, block_mask=block_mask)
    check(got, want)
    torch._dynamo.reset()  # eager FlexAttention compiled its call: leave no compiled code behind


# ------------------------------------------------------------------------------------------ xformers
def _xformers_cases() -> list[tuple[str, Any]]:
    return ["lower", "lower_bias", "bottom_right_local", "local_lr", "block_causal", "tensor", "gqa"]


@pytest.mark.parametrize("case", _xformers_cases())
def test_xformers_memory_efficient_attention(case: str) -> None:
    with installed():
        import xformers.ops as xops

        ab = xops.fmha.attn_bias
        q, k, v = randn(2, 9, 4, 8, scale=2), randn(2, 11, 4, 8, scale=2), randn(2, 11, 4, 8)
        ref: dict[str, Any] = {}
        if case == "lower":
            bias: Any = ab.LowerTriangularMask()
            ref = {"causal": True}
        elif case == "lower_bias":
            t = randn(2, 4, 9, 11)
            bias, ref = ab.LowerTriangularMask().add_bias(t), {"causal": True, "attn_mask": t}
        elif case == "bottom_right_local":
            bias = ab.LowerTriangularFromBottomRightMask().make_local_attention(3)
            ref = {"causal": True, "causal_align": "bottom_right", "window": (2, 0)}
        elif case == "local_lr":
            bias = ab.LocalAttentionFromBottomRightMask(window_left=2, window_right=1)
            ref = {"causal_align": "bottom_right", "window": (2, 1)}
        elif case == "block_causal":
            bias = ab.BlockDiagonalCausalMask.from_seqlens([3, 6], [5, 6])
            q, k, v = q[:1], randn(1, 11, 4, 8, scale=2), randn(1, 11, 4, 8)
            cu_q, cu_k = torch.tensor([0, 3, 9]), torch.tensor([0, 5, 11])
            ref = {"causal": True, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
        elif case == "tensor":
            bias = randn(2, 4, 9, 11)
            bias[:, :, :, -2:] = float("-inf")
            ref = {"attn_mask": bias}
        else:  # BMGHK: 2 groups of 2 heads, one key head per group expanded over its heads
            q = randn(2, 9, 2, 2, 8, scale=2)
            k1, v1 = randn(2, 11, 2, 1, 8, scale=2), randn(2, 11, 2, 1, 8)
            k, v = k1.expand(-1, -1, -1, 2, -1), v1.expand(-1, -1, -1, 2, -1)
            bias = ab.LowerTriangularMask()
            ref = {"causal": True}
        with kernels.install(), Measure() as m:
            xops.memory_efficient_attention(q, k, v, attn_bias=bias)  # looked up after the wrap
    (got,) = m.stats
    assert m.calls[0].kernel == "xformers"
    if case == "gqa":
        want = reference_stats(q.flatten(2, 3).transpose(1, 2), k1[:, :, :, 0].transpose(1, 2), **ref)
    else:
        want = reference_stats(bhsd(q), bhsd(k), **ref)
    check(got, want)


# ------------------------------------------------------------------------------------------ Transformer Engine
@pytest.mark.parametrize(
    ("fmt", "mask_type", "extra"),
    [
        ("sbhd", "causal", {}),
        ("bshd", "causal_bottom_right", {"window_size": (3, 0)}),
        ("bshd", "padding_causal", {"padding": True}),
        ("thd", "padding_causal", {}),
        ("bshd", "no_mask", {"softmax_type": "learnable"}),
        ("bshd", "causal", {"softmax_type": "off-by-one", "alibi": True}),
    ],
)
def test_transformer_engine_dot_product_attention(fmt: str, mask_type: str, extra: dict) -> None:
    with installed():
        from transformer_engine.pytorch import DotProductAttention

        softmax_type = extra.get("softmax_type", "vanilla")
        attn = DotProductAttention(
            4, 8, num_gqa_groups=2, qkv_format=fmt, attn_mask_type=mask_type, softmax_type=softmax_type
        )
        if softmax_type == "learnable":
            with torch.no_grad():
                attn.softmax_offset.normal_(0.0, 2.0, generator=G)
        b, s = 2, 10
        kw: dict[str, Any] = {}
        ref: dict[str, Any] = {"causal": "causal" in mask_type}
        ref["causal_align"] = "bottom_right" if mask_type.endswith("bottom_right") else "top_left"
        if fmt == "thd":
            cu = torch.tensor([0, 4, 10], dtype=torch.int32)
            q, k, v = randn(10, 4, 8, scale=2), randn(10, 2, 8, scale=2), randn(10, 2, 8)
            kw = {"cu_seqlens_q": cu, "cu_seqlens_kv": cu, "max_seqlen_q": 6, "max_seqlen_kv": 6}
            qh, kh = q.transpose(0, 1)[None], k.transpose(0, 1)[None]
            ref.update(cu_seqlens_q=cu, cu_seqlens_k=cu)
        else:
            shape_q, shape_k = ((s, b, 4, 8), (s, b, 2, 8)) if fmt == "sbhd" else ((b, s, 4, 8), (b, s, 2, 8))
            q, k, v = randn(*shape_q, scale=2), randn(*shape_k, scale=2), randn(*shape_k)
            qh = q.permute(1, 2, 0, 3) if fmt == "sbhd" else bhsd(q)
            kh = k.permute(1, 2, 0, 3) if fmt == "sbhd" else bhsd(k)
        if extra.get("padding"):
            pad = torch.zeros(b, 1, 1, s, dtype=torch.bool)
            pad[1, ..., 7:] = True  # the second sequence has 7 tokens
            kw["attention_mask"] = pad
            keep = ~pad.reshape(b, 1, 1, s)
            ref["attn_mask"] = keep & keep.transpose(-1, -2)
        if "window_size" in extra:
            kw["window_size"] = extra["window_size"]
            ref["window"] = (extra["window_size"][0], 0)
        if extra.get("alibi"):
            slopes = torch.rand(4, generator=G)
            kw.update(core_attention_bias_type="alibi", alibi_slopes=slopes)
            ref["alibi_slopes"] = slopes
        if softmax_type == "learnable":
            ref["sinks"] = attn.softmax_offset.detach()
        elif softmax_type == "off-by-one":
            ref["sinks"] = torch.zeros(4)
        with kernels.install(), Measure() as m:
            attn(q, k, v, **kw)
    (got,) = m.stats
    assert m.calls[0].kernel == "transformer_engine"
    want = reference_stats(qh, kh, **ref)
    check(got, want, sinks="sinks" in ref)


# ------------------------------------------------------------------------------------------ aten and registered
def test_aten_sdpa_ops_called_directly() -> None:
    q, k, v = randn(2, 4, 9, 8, scale=2), randn(2, 4, 9, 8, scale=2), randn(2, 4, 9, 8)
    with measuring() as m:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=0.3)
        torch.ops.aten.scaled_dot_product_attention.default(q, k, v, is_causal=True, scale=0.3)
    assert [c.kernel for c in m.calls] == ["aten_sdpa", "aten_sdpa"]
    want = reference_stats(q, k, scale=0.3, causal=True)
    for got in m.stats:
        check(got, want)


@torch.library.custom_op("stabkit_test::windowed_attention", mutates_args=())
def windowed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, window: list[int]
) -> torch.Tensor:
    """An in-house kernel: (B, S, H, D) layout, bottom-right causal, a window."""
    s = torch.einsum("blhd,bshd->bhls", q, k) * scale
    i = torch.arange(q.shape[1])[:, None] + k.shape[1] - q.shape[1]
    j = torch.arange(k.shape[1])[None]
    blocked = (j > i) if causal else torch.zeros_like(j > i)
    blocked = blocked | (j < i - window[0])
    p = torch.exp(s.masked_fill(blocked, float("-inf")) - s.amax(-1, keepdim=True))
    return torch.einsum("bhls,bshd->blhd", p / p.sum(-1, keepdim=True), v)


@windowed_attention.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, window: list[int]
) -> Any:
    return torch.empty_like(q)


def python_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, is_causal: bool
) -> torch.Tensor:
    """A Python kernel (module level): (B, H, S, D), top-left causal."""
    return F.scaled_dot_product_attention(query, key, value, is_causal=is_causal)


def test_register_kernel_for_a_custom_op_and_a_python_function() -> None:
    op = kernels.register_kernel(
        "stabkit_test::windowed_attention", layout="bshd", causal="causal", causal_align="bottom_right",
        scale="scale", window="window",
    )  # fmt: skip
    fn = kernels.register_kernel(python_attention, q="query", k="key", causal="is_causal")
    try:
        q, k, v = randn(2, 6, 4, 8, scale=2), randn(2, 9, 4, 8, scale=2), randn(2, 9, 4, 8)
        with measuring() as m:
            torch.ops.stabkit_test.windowed_attention(q, k, v, True, 0.5, [3, 0])
            here = sys.modules[python_attention.__module__]  # its module attribute is the wrapper now
            here.python_attention(bhsd(q), bhsd(k)[:, :, :6], bhsd(v)[:, :, :6], True)
        assert [c.kernel for c in m.calls] == [op.name, fn.name]
        check(m.stats[0], reference_stats(bhsd(q), bhsd(k), scale=0.5, causal=True, causal_align="bottom_right",
                                          window=(3, 0)))  # fmt: skip
        check(m.stats[1], reference_stats(bhsd(q), bhsd(k)[:, :, :6], causal=True))
    finally:
        kernels.forget_kernel(op.name)
        kernels.forget_kernel(fn.name)
    with pytest.raises(ValueError, match=r"has no argument\(s\) \['mask'\]"):
        kernels.register_kernel("stabkit_test::windowed_attention", layout="bshd", causal="mask")
    with pytest.raises(ValueError, match="layout must be one of"):
        kernels.register_kernel("stabkit_test::windowed_attention", layout="hsd")
