"""Whole-tensor norms and the probes' own reductions in a hook.

- `norm_f32` of a whole contiguous float32 CPU tensor (BLAS's dot) is within float32 rounding of a
  float64 hand computation up to ~10⁶ entries, and within 5e-5 at 2²² (1–4e-5 with one or two threads) where a plain float32
  ``vector_norm`` is ~1e-4 off; other layouts and dtypes keep ``vector_norm``; Inf and NaN propagate.
- `reduce_plain`: a torch-function mode on the stack (an attention scope's) does not see the
  reductions of a plain tensor, and the numbers are the same; a tensor subclass keeps its handling.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from stabkit.probes.base import reduce_plain
from stabkit.stats.reductions import norm_f32
from stabkit.stats.tensor_batch import reduce_tensor


def hand_norm(x: torch.Tensor) -> float:
    return math.sqrt(float((x.double() ** 2).sum()))


@pytest.mark.parametrize(("n", "rel"), [(1, 1e-7), (1000, 1e-6), (1 << 18, 2e-6), (1 << 22, 5e-5)])
def test_whole_float32_norm_is_close_to_float64(n: int, rel: float) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3 + 1  # a mean: sums that drift
    got = float(norm_f32(x.view(-1, 4) if n % 4 == 0 else x))
    assert got == pytest.approx(hand_norm(x), rel=rel)


@pytest.mark.parametrize(
    "make",
    [
        lambda g: torch.randn(64, 48, generator=g).t(),  # not contiguous
        lambda g: torch.randn(64, 48, generator=g).to(torch.bfloat16),
        lambda g: torch.randn(64, 48, generator=g).double(),
    ],
)
def test_other_layouts_and_dtypes_are_normed_as_before(make) -> None:
    x = make(torch.Generator().manual_seed(3))
    want = torch.linalg.vector_norm(x, dtype=torch.float32) if x.dtype != torch.float64 else None
    got = norm_f32(x)
    assert got.dtype == torch.float32
    if want is not None:
        assert torch.equal(got, want)
    assert float(got) == pytest.approx(hand_norm(x.float()), rel=1e-3)


def test_overflow_and_nan_propagate() -> None:
    assert math.isinf(float(norm_f32(torch.full((100,), 1e20))))
    x = torch.ones(100)
    x[7] = float("nan")
    assert math.isnan(float(norm_f32(x)))


class Counting(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return func(*args, **(kwargs or {}))


class Tagged(torch.Tensor):
    """A subclass whose torch-function handling counts calls."""

    seen = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        cls.seen += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_reductions_of_a_plain_tensor_pass_by_modes_with_the_same_numbers() -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(4))
    outside = reduce_tensor(x)
    mode = Counting()
    with torch.no_grad(), mode:
        inside = reduce_plain(reduce_tensor, x)
        assert mode.calls == 0
        reduce_tensor(x)  # the same reductions, seen by the mode when not passed by it
        assert mode.calls > 0
    assert torch.equal(inside.norm, outside.norm) and torch.equal(inside.high, outside.high)
    assert torch.equal(inside.low, outside.low) and inside.numel == outside.numel


def test_a_tensor_subclass_keeps_its_torch_function_handling() -> None:
    x = torch.randn(8, 16).as_subclass(Tagged)
    Tagged.seen = 0
    with torch.no_grad(), Counting():
        reduce_plain(reduce_tensor, x)
    assert Tagged.seen > 0
