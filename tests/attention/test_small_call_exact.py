"""A call whose sample (rows × queries) plus max candidates would read as many query rows as the whole
call is measured whole: exactly, and for less (`stabkit.attention.measure.measure._sample_is_smaller`)."""

from __future__ import annotations

import torch

from stabkit.attention.call import LogitsCall, QKCall
from stabkit.attention.measure.measure import measure
from stabkit.attention.measure.stats import EXACT, Sampling

DEFAULT_SAMPLE = Sampling(rows=4, queries=64, round=3)  # MonitorConfig's attn_sample_rows/queries


def _qk(batch: int, length: int) -> QKCall:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 2, length, 16, generator=gen) * 2
    k = torch.randn(batch, 2, length, 16, generator=gen) * 2
    return QKCall(q, k, None, causal=True)


def test_a_small_call_is_measured_whole_with_the_default_sample() -> None:
    call = _qk(batch=8, length=64)  # 4 × 64 sampled + 8 rows × 32 candidates = 512 = 8 × 64
    sampled, exact = measure(call, DEFAULT_SAMPLE), measure(call, EXACT)
    assert sampled.rows.tolist() == [8 * 64, 8 * 64]  # every query row of each head
    torch.testing.assert_close(sampled.max_logit, exact.max_logit, rtol=0, atol=0)
    torch.testing.assert_close(sampled.entropy_sum, exact.entropy_sum, rtol=0, atol=0)
    # the materialised reference: the largest |q·k/√d| over the allowed (causal) keys
    logits = call.q @ call.k.transpose(-1, -2) / 4.0
    allowed = torch.ones(64, 64, dtype=torch.bool).tril()
    top = logits.abs().masked_fill(~allowed, 0).amax(dim=(0, 2, 3))
    torch.testing.assert_close(sampled.max_logit, top)


def test_a_large_call_is_still_sampled() -> None:
    call = _qk(batch=8, length=512)  # 4 × 64 + 8 × 32 = 512 of 4096 rows
    stats = measure(call, DEFAULT_SAMPLE)
    assert stats.rows.tolist() == [4 * 64, 4 * 64]  # the uniform sample's rows (candidates give the max only)


def test_materialised_logits_follow_the_same_rule() -> None:
    gen = torch.Generator().manual_seed(1)
    small = LogitsCall(torch.randn(2, 2, 32, 32, generator=gen))  # 1 × 32 + 2 × 16 = all 64 rows
    assert measure(small, Sampling(rows=1, queries=32)).rows.tolist() == [64, 64]
    assert measure(small, Sampling(rows=1, queries=16)).rows.tolist() == [16, 16]  # 16 + 2 × 8 < 64
    large = LogitsCall(torch.randn(8, 2, 256, 256, generator=gen))
    assert measure(large, Sampling(rows=1, queries=16)).rows.tolist() == [16, 16]
