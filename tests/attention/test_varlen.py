"""``torch.nn.attention.varlen.varlen_attn`` (torch 2.13, torchtitan's ``VarlenAttention``) seen and measured
per document (issue 38, item 4). Its op ``torch_attn::_varlen_attn`` runs flash-attn 2's kernel, which
has no CPU implementation: the mode below reads each call as the attention probe does, then returns zeros
instead of running the kernel. Expectations: the float64 reference of `tests/standins/reference.py`
(documents from the cumulative lengths, causal and windows bottom-right per document, as flash-attn).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from standins.reference import reference_stats
from torch.overrides import TorchFunctionMode

from stabkit.attention import kernels
from stabkit.attention.measure.measure import measure
from stabkit.attention.measure.stats import HeadStats

from .test_kernels import check, randn

varlen = pytest.importorskip("torch.nn.attention.varlen")
torch.set_num_threads(1)
H, KV, D = 4, 2, 8


class ReadOnly(TorchFunctionMode):
    """Reads and measures every known-kernel call; answers it with zeros (no CPU kernel to run)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.stats: list[HeadStats] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        kernel = kernels.lookup(func)
        if kernel is None:
            return func(*args, **kwargs)
        with torch.no_grad():
            self.names.append(kernel.name)
            self.stats.append(measure(kernels.read_call(kernel, func, args, kwargs)))
        q = args[0]
        return torch.zeros_like(q), torch.zeros(q.shape[:2]), torch.zeros(2)


@pytest.mark.parametrize(
    ("window", "lengths_q"), [((-1, 0), [3, 5]), ((2, 0), [3, 5]), ((-1, -1), [4, 4]), ((1, 2), [2, 4])]
)
def test_varlen_attn_is_read_per_document(window: tuple[int, int], lengths_q: list[int]) -> None:
    lengths_k = [5, 6]
    cu_q = torch.tensor([0, lengths_q[0], sum(lengths_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, lengths_k[0], sum(lengths_k)], dtype=torch.int32)
    q, k, v = randn(sum(lengths_q), H, D, scale=2), randn(11, KV, D, scale=2), randn(11, KV, D)
    with ReadOnly() as m:
        varlen.varlen_attn(
            q, k, v, cu_q, cu_k, max(lengths_q), 6, window_size=window, scale=0.3, enable_gqa=True
        )
    assert m.names == ["varlen_attn"]
    packed = lambda x: x.transpose(0, 1)[None]  # noqa: E731
    want = reference_stats(
        packed(q), packed(k), scale=0.3, causal=window == (-1, 0), causal_align="bottom_right",
        window=window if window != (-1, 0) else (-1, -1), cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
    )  # fmt: skip
    check(m.stats[0], want)


def test_a_kv_cache_call_is_refused() -> None:
    cu = torch.tensor([0, 3], dtype=torch.int32)
    q = randn(3, H, D)
    kernel = kernels.KERNELS["varlen_attn"]
    op = torch.ops.torch_attn._varlen_attn
    with pytest.raises(ValueError, match="seqused_k"):
        kernels.read_call(kernel, op, (q, q, q, cu, cu, 3, 3), {"seqused_k": torch.tensor([3])})
