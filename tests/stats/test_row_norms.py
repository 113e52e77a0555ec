"""`row_norms_f32`: the L2 norms over the last dim read in memory order (a transposed projection as
the dense matrix it is) are `norm_f32(x, dim=-1)` bit for bit, whatever the layout and dtype, and a
float64 hand computation to float32 precision."""

from __future__ import annotations

import pytest
import torch

from stabkit.stats.reductions import norm_f32, row_norms_f32


@pytest.mark.parametrize(
    ("shape", "view"),
    [
        ((16, 128, 4, 32), lambda t: t.transpose(1, 2)),  # a (B, T, H, E) projection seen as (B, H, T, E)
        ((2, 9, 3, 4, 8), lambda t: t[:, :, 1].transpose(1, 2)),  # k of a fused qkv: no permutation is dense
        ((3, 5, 2, 4), lambda t: t.permute(2, 0, 1, 3)),
        ((4, 1, 6, 8), lambda t: t.transpose(1, 2)),
        ((6, 4), lambda t: t),
        ((8, 10), lambda t: t[:, ::2]),  # strided last dim
        ((4, 8, 6), lambda t: t.transpose(-1, -2)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_row_norms_read_in_memory_order_are_the_norms_bit_for_bit(shape, view, dtype) -> None:
    x = view(torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype))
    expected = norm_f32(x, dim=-1)
    got = row_norms_f32(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert torch.equal(got, expected)
    hand = x.double().pow(2).sum(-1).sqrt().float()
    torch.testing.assert_close(got, hand, rtol=1e-5, atol=0)
