"""The attention probe summarises the calls of a step together (`HeadStats.stacked`): the same values
as one call at a time (the compiled op's per-call summary)."""

from __future__ import annotations

import pytest
import torch

from stabkit.attention.measure.op import summary_values
from stabkit.attention.measure.stats import HeadStats


def _call(seed: int, heads: int, sinks: bool) -> HeadStats:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 5, (heads,), generator=g).float()  # a head may have no measured rows
    stats = HeadStats(
        max_logit=torch.rand(heads, generator=g) * 30,
        entropy_sum=torch.rand(heads, generator=g) * rows * 3,
        rows=rows,
        first_sum=torch.rand(heads, generator=g) * rows,
    )
    if sinks:
        stats.sink_sum = torch.rand(heads, generator=g) * rows
    return stats


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize(("seen_capped", "applied_cap"), [(None, None), (30.0, None), (None, 50.0)])
@pytest.mark.parametrize("per_head", [False, True])
def test_stacked_summary_equals_per_call(
    sinks: bool, seen_capped: float | None, applied_cap: float | None, per_head: bool
) -> None:
    calls = [_call(seed, heads=6, sinks=sinks) for seed in range(5)]
    together = summary_values(HeadStats.stacked(calls), seen_capped, applied_cap, per_head)
    for c, stats in enumerate(calls):
        alone = summary_values(stats, seen_capped, applied_cap, per_head)
        assert len(alone) == len(together)
        for value, column in zip(alone, together, strict=True):
            assert column.shape == (len(calls),)
            torch.testing.assert_close(column[c], value, rtol=1e-6, atol=0.0)


def test_stacked_keeps_missing_sums_missing() -> None:
    calls = [_call(1, 4, sinks=False), _call(2, 4, sinks=False)]
    stacked = HeadStats.stacked(calls)
    assert stacked.sink_sum is None
    assert stacked.first_sum is not None and stacked.first_sum.shape == (2, 4)
    assert torch.equal(stacked.max_logit[1], calls[1].max_logit)


def test_calls_on_different_devices_are_summarised_apart() -> None:
    from stabkit.probes.attention import _shape_of

    here = _call(3, 4, sinks=False)
    there = HeadStats(*(t.to("meta") for t in (here.max_logit, here.entropy_sum, here.rows)))
    there.first_sum = here.first_sum.to("meta")  # type: ignore[union-attr]
    assert _shape_of(here) != _shape_of(there)
    assert _shape_of(here) == _shape_of(_call(4, 4, sinks=False))
