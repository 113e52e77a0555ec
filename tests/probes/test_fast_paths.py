"""The probes' fast paths give the numbers of the general code they stand in for.

- Attention: the one-block path (`stabkit.attention.measure.fast`) is bitwise the blocked path on finite logits, for
  causal and unmasked calls, GQA, half/double precision, soft caps and every sampling; calls it does
  not take (a bias, a boolean mask) go to the blocked path.
- The compiled attention op on a CPU reads its round and measures the eager sample on the one-block
  path: bitwise the eager numbers (the round on the device, index tensors, gives them within rounding).
- Outliers: `outlier_stats` over token blocks equals one block and a float64 hand computation; traced
  and compiled by Inductor (what full monitoring does under torch.compile) it gives the same values;
  so do the output-logit statistics, against a float64 hand computation.
- Update norms: Adam(W) rebuilt in foreach batches (several batches, one) equals the real change.
- Unit norms: the per-unit L2 of a subset of parameters equals the unit-by-unit sums.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from zoo import batch, lm_loss, reference_gpt

from stabkit.attention.call import QKCall
from stabkit.attention.measure import fast as attention_fast
from stabkit.attention.measure import measure as attention_measure
from stabkit.attention.measure import op as attention_op
from stabkit.attention.measure.stats import Sampling
from stabkit.probes import updates
from stabkit.probes.unit_norms import UnitNorms
from stabkit.stats import outliers
from stabkit.stats.opaque import logit_values, outlier_values
from stabkit.stats.outliers import outlier_stats
from stabkit.stats.reductions import LOGZ_CHUNK_BYTES

FIELDS = ("max_logit", "entropy_sum", "rows", "first_sum")
CASES = list(
    itertools.product(
        [True, False],  # causal
        [4, 2],  # kv heads (GQA at 2)
        [torch.float32, torch.bfloat16, torch.float64],
        [None, 5.0],  # the probe's cap
        [None, 7.0],  # the call's own soft cap
        [(4, 16), (None, None), (2, None), (None, 8)],  # sampling rows, queries
    )
)


@pytest.mark.parametrize("causal,kv,dtype,cap,softcap,sampling", CASES)
def test_one_block_attention_is_bitwise_the_blocked_path(
    causal: bool, kv: int, dtype: torch.dtype, cap: float | None, softcap: float | None, sampling: tuple
) -> None:
    g = torch.Generator().manual_seed(len(str((causal, kv, dtype, cap, softcap, sampling))))
    keys = 32 if causal else 20
    for round_ in (0, 3):
        q = (torch.randn(6, 32, 4, 16, generator=g) * 3).to(dtype).transpose(1, 2)  # (B, H, L, E) strided
        k = (torch.randn(6, keys, kv, 16, generator=g) * 3).to(dtype).transpose(1, 2)
        call = QKCall(q=q, k=k, scale=None, causal=causal, softcap=softcap)
        chosen = Sampling(*sampling, round=round_)
        assert attention_fast.applies(call, chosen)
        fast = attention_measure.measure(call, chosen, cap, 1 << 30)
        blocked = attention_measure._measure_qk(call, chosen, softcap or cap, 1 << 30)
        for name in FIELDS:
            assert torch.equal(getattr(fast, name), getattr(blocked, name)), name


def test_calls_the_one_block_path_does_not_take_go_to_the_blocked_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    taken = []
    original = attention_fast.measure_one_block
    monkeypatch.setattr(
        attention_fast, "measure_one_block", lambda *a, **k: taken.append(1) or original(*a, **k)
    )
    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 16, 8)
    sampling = Sampling(None, None)
    attention_measure.measure(QKCall(q, k, None, causal=True), sampling, None, 1 << 30)
    assert taken == [1]
    mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).tril()
    attention_measure.measure(QKCall(q, k, None, allowed=mask), sampling, None, 1 << 30)
    attention_measure.measure(QKCall(q, k, None, bias=torch.zeros(1, 1, 16, 16)), sampling, None, 1 << 30)
    attention_measure.measure(QKCall(q, k, None, causal=True), sampling, None, 4096)  # too big for one block
    assert taken == [1]


@pytest.mark.parametrize("causal", [True, False])
def test_attention_op_on_a_cpu_measures_the_eager_sample_bitwise(
    causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(6, 32, 4, 16, generator=g) * 3).transpose(1, 2)  # (B, H, L, E) strided
    k = (torch.randn(6, 32, 2, 16, generator=g) * 3).transpose(1, 2)
    taken: list[int] = []
    original = attention_fast.measure_one_block
    monkeypatch.setattr(
        attention_fast, "measure_one_block", lambda *a, **kw: taken.append(1) or original(*a, **kw)
    )
    for round_ in (0, 1, 5):
        call = QKCall(q, k, None, causal=causal)
        eager = attention_measure.measure(call, Sampling(2, 8, round=round_), None, 1 << 30)
        want = attention_op.packed(attention_op.summary_values(eager, None, None, True))
        args = (
            q,
            k,
            None,
            None,
            None,
            torch.tensor(round_),
            causal,
            None,
            None,
            None,
            None,
            2,
            8,
            1 << 30,
            True,
        )
        got = torch.ops.stabkit.attention_qk(*args, -1, 1)
        assert torch.equal(got, want)
        on_device = Sampling(2, 8, counter=torch.tensor(round_))  # an accelerator's path: index tensors
        indexed = attention_measure.measure(call, on_device, None, 1 << 30)
        by_index = attention_op.packed(attention_op.summary_values(indexed, None, None, True))
        torch.testing.assert_close(by_index, want, rtol=1e-6, atol=1e-6)
    assert len(taken) == 2 * 3  # the eager sample and the op's, each round; never the index tensors


def test_one_block_nan_key_makes_only_its_head_nan() -> None:
    q, k = torch.randn(1, 2, 9, 4) * 4, torch.randn(1, 2, 9, 4) * 4
    k[0, 1, 6] = torch.nan
    got = attention_measure.measure(QKCall(q, k, None, causal=True), Sampling(None, None), None, 1 << 30)
    assert torch.isnan(got.max_logit[1]) and torch.isnan(got.entropy_sum[1])
    assert torch.isfinite(got.max_logit[0]) and torch.isfinite(got.entropy_sum[0])


def reference_outliers(x: torch.Tensor) -> tuple[float, float, float]:
    """float64 hand computation of (massive_ratio, massive_dim, kurtosis), every token's median."""
    flat = x.double().reshape(-1, x.shape[-1]).abs()
    top = flat.amax(-1)
    median = flat.sort(-1).values[:, (flat.shape[-1] - 1) // 2]
    ratio = (top / median).max().item()
    dim = flat.reshape(-1).argmax().item() % flat.shape[-1]
    channel = x.double().reshape(-1, x.shape[-1]).pow(2).mean(0).sqrt()
    c = channel - channel.mean()
    kurtosis = (c.pow(4).mean() / c.pow(2).mean().pow(2) - 3).item()
    return ratio, float(dim), kurtosis


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_outlier_stats_in_token_blocks_equal_one_block_and_a_hand_computation(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 30, 48, generator=g)
    x[1, 7, 5] = 400.0  # a massive activation in channel 5
    x[..., 11] *= 9  # an outlier feature
    x = x.to(dtype)
    whole = outlier_stats(x)
    monkeypatch.setattr(outliers, "CHUNK_ELEMENTS", 48 * 7)  # 7 tokens per block: 9 blocks, the last short
    blocked = outlier_stats(x)
    assert [float(v) for v in whole] == pytest.approx([float(v) for v in blocked], rel=1e-6)
    want = reference_outliers(x)
    got = [float(v) for v in whole]
    assert got[0] == pytest.approx(want[0], rel=1e-5) and got[1] == want[1] == 5.0
    assert got[2] == pytest.approx(want[2], rel=1e-4)


def test_outlier_statistics_compiled_by_inductor_equal_eager() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 900, 96, generator=g)  # more entries than one eager block: the eager code loops
    x[2, 640, 17] = 900.0  # a massive activation in channel 17
    x[..., 3] *= 12  # an outlier feature
    assert x.numel() > outliers.CHUNK_ELEMENTS
    eager = outlier_values(x)
    compiled = torch.compile(outlier_values, backend="inductor", fullgraph=True)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=0)
    assert float(eager[1]) == 17.0 and float(eager[0]) > 500 and float(eager[3]) == 1.0


def test_logit_statistics_compiled_by_inductor_equal_eager() -> None:
    logits = torch.randn(3, 700, 1000, generator=torch.Generator().manual_seed(6)) * 4
    logits[1, 5, 999] = -80.0  # the largest |logit|
    assert logits.numel() * 4 > 2 * LOGZ_CHUNK_BYTES  # the eager code takes row chunks
    eager = logit_values(logits)
    compiled = torch.compile(logit_values, backend="inductor", fullgraph=True)(logits)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    logz = torch.logsumexp(logits.double(), dim=-1)
    want = [80.0, float(logz.mean()), float(logz.max()), float(logits.double().mean()), 1.0]
    assert [float(v) for v in eager] == pytest.approx(want, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("batch_elements", [1, 5000, 1 << 30])
@pytest.mark.parametrize("name", ["adamw", "adam_l2", "adamw_amsgrad"])
def test_adam_update_norms_in_foreach_batches_equal_the_real_change(
    name: str, batch_elements: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(updates, "BATCH_ELEMENTS", batch_elements)
    torch.manual_seed(0)
    model = reference_gpt()
    params = list(model.parameters())
    make = {
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
        "adam_l2": lambda: torch.optim.Adam(params, lr=1e-2, weight_decay=0.05, betas=(0.8, 0.9)),
        "adamw_amsgrad": lambda: torch.optim.AdamW(params, lr=3e-3, amsgrad=True, maximize=True),
    }
    opt = make[name]()
    for step in range(3):
        x, y = batch(step)
        lm_loss(model(x), y).backward()
        before = [p.detach().clone() for p in params]
        opt.step()
        got = torch.stack(updates.update_norms(opt, params))
        want = torch.stack([(p.detach() - b).norm() for p, b in zip(params, before)])
        torch.testing.assert_close(got, want, rtol=2e-3, atol=1e-7)
        opt.zero_grad()


def test_unit_norms_of_a_subset_equal_unit_by_unit_sums() -> None:
    g = torch.Generator().manual_seed(2)
    unit_index = [0, 0, 1, 2, 2, 2, 1]
    norms = [torch.rand((), generator=g) for _ in unit_index]
    unit_norms = UnitNorms.of(unit_index, 3, [torch.device("cpu")] * len(unit_index))
    for idx in (list(range(7)), [0, 3, 6], [2]):
        squares = unit_norms.squares(idx, [norms[i] for i in idx])
        assert squares is not None
        for u in unit_norms.units(idx):
            want = sum(float(norms[i]) ** 2 for i in idx if unit_index[i] == u)
            assert float(squares[u]) == pytest.approx(want, rel=1e-6)
        assert unit_norms.units(idx) == sorted({unit_index[i] for i in idx})
    several = UnitNorms.of([0, 1], 2, [torch.device("cpu"), torch.device("meta")])
    assert several.squares([0, 1], norms[:2]) is None  # parameters on two devices: unit by unit
