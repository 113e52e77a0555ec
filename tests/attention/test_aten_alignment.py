"""The aten SDPA ops called directly with ``is_causal=True`` and L != S: read with the alignment each op
computes (issue 38, item 4). torch 2.13: the CUDA flash op runs flash-attn 2's kernel, causal aligned
bottom-right (``aten/src/ATen/native/transformers/sdp_utils.cpp``, ``check_flash_causal_non_square_seqlens``);
the CPU flash op and the math op are top-left (checked here against their own outputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from standins.reference import reference_stats

from stabkit.attention import kernels
from stabkit.attention.measure.measure import measure

from .test_kernels import check, randn

torch.set_num_threads(1)


def _measured(op: object, *args: object, **kw: object) -> tuple[str, object]:
    kernel = kernels.lookup(op)
    assert kernel is not None
    with torch.no_grad():
        call = kernels.read_call(kernel, op, args, kw)
        return kernel.name, measure(call)


def test_the_cuda_flash_op_is_read_bottom_right() -> None:
    # the op has no CPU kernel: its call is read (what the probe does before the op runs), not run
    q, k = randn(2, 4, 3, 8, scale=2), randn(2, 4, 9, 8, scale=2)
    v = randn(2, 4, 9, 8)
    name, got = _measured(torch.ops.aten._scaled_dot_product_flash_attention, q, k, v, 0.0, True, scale=0.3)
    assert name == "aten_sdpa_flash"
    want = reference_stats(q, k, scale=0.3, causal=True, causal_align="bottom_right")
    check(got, want)  # type: ignore[arg-type]
    top_left = reference_stats(q, k, scale=0.3, causal=True)
    assert not torch.allclose(top_left["max_logit"], want["max_logit"])  # the alignment matters here


def test_the_cuda_flash_op_square_is_plain_causal() -> None:
    q, k, v = randn(1, 2, 6, 8, scale=2), randn(1, 2, 6, 8, scale=2), randn(1, 2, 6, 8)
    _, got = _measured(torch.ops.aten._scaled_dot_product_flash_attention.default, q, k, v, is_causal=True)
    check(got, reference_stats(q, k, causal=True))  # type: ignore[arg-type]


def test_the_cpu_ops_stay_top_left_as_they_compute() -> None:
    q, k, v = randn(1, 2, 3, 8, scale=2), randn(1, 2, 7, 8, scale=2), randn(1, 2, 7, 8)
    top_left = torch.ones(3, 7, dtype=torch.bool).tril()
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=top_left))
    for op in (
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
        torch.ops.aten._scaled_dot_product_attention_math,
    ):
        name, got = (
            _measured(op, q, k, v, 0.0, True) if "cpu" in str(op) else _measured(op, q, k, v, is_causal=True)
        )
        assert name == "aten_sdpa"
        check(got, reference_stats(q, k, causal=True))  # type: ignore[arg-type]
