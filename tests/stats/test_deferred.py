"""Deferred finishing: hooks keep reductions, the statistics are made at the step's first read.

- `Recorder.defer` runs a finisher once however often it was deferred, before `current`,
  `current_names` and `commit`; `add_vector` combines over micro-batches like `add`.
- `reduce_tensor` + `finish_tensors` give `tensor_stats` bit for bit (finite, non-finite, empty,
  integer, bfloat16 tensors), and `reduce_outliers` + `finish_outliers` give `outlier_stats`.
- In a monitored model with two micro-batches, the deferred activation statistics equal a
  hand computation over both (rms over the two, max of the maxima).
"""

from __future__ import annotations

import math

import pytest
import torch
from zoo import batch, lm_loss, reference_gpt, train_steps

import stabkit
from stabkit.probes.base import ProbeError
from stabkit.stats import Recorder, outlier_stats, tensor_stats
from stabkit.stats.outliers import finish_outliers, finish_outliers_stacked, reduce_outliers
from stabkit.stats.tensor_batch import by_device, finish_tensors, reduce_tensor


def test_a_deferred_finisher_runs_once_before_any_read() -> None:
    rec = Recorder()
    calls: list[int] = []

    class Probe:
        def finish(self) -> None:
            calls.append(1)
            rec.add_vector(("a", "b"), torch.tensor([3.0, 4.0]), combine="rms", reduction="rms")

    probe = Probe()
    rec.defer(probe.finish)
    rec.defer(probe.finish)  # the same bound method: once
    assert rec.current_names() == ["a", "b"] and calls == [1]
    assert float(rec.current("a")) == 3.0
    rec.add_vector(("a", "b"), torch.tensor([4.0, 0.0]), combine="rms", reduction="rms")  # a micro-batch
    values = rec.commit(0)
    assert calls == [1]
    assert float(values["a"]) == pytest.approx(math.sqrt((9 + 16) / 2))
    assert float(values["b"]) == pytest.approx(math.sqrt(16 / 2))
    assert rec.reductions["a"] == "rms"


@pytest.mark.parametrize("combine", ["max", "min", "sum", "mean", "last"])
def test_add_vector_combines_like_add(combine: str) -> None:
    one, many = Recorder(), Recorder()
    for values in ([1.0, -2.0], [3.0, -5.0]):
        for name, v in zip(("x", "y"), values, strict=True):
            one.add(name, torch.tensor(v), combine=combine)  # type: ignore[arg-type]
        many.add_vector(("x", "y"), torch.tensor(values), combine=combine)  # type: ignore[arg-type]
    a, b = one.commit(0), many.commit(0)
    assert {k: float(v) for k, v in a.items()} == {k: float(v) for k, v in b.items()}


def cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    nan = torch.randn(5, 7, generator=g)
    nan[2, 3] = math.nan
    inf = torch.randn(3, 9, generator=g)
    inf[0, 0], inf[1, 1] = math.inf, -math.inf
    return [
        torch.randn(4, 8, 16, generator=g) * 3,
        torch.randn(33, generator=g).bfloat16(),
        torch.randn(6, 5, generator=g).double(),
        torch.arange(-4, 7).view(11, 1),
        torch.zeros(0, 4),
        nan,
        inf,
    ]


def test_reduced_then_finished_tensor_stats_are_bitwise_tensor_stats() -> None:
    tensors = cases()
    kept = [reduce_tensor(t) for t in tensors]
    assert list(by_device(kept)) == [torch.device("cpu")]
    rms, absmax, nonfinite = finish_tensors(kept)
    for i, t in enumerate(tensors):
        want = tensor_stats(t)
        for got, expected in zip((rms[i], absmax[i], nonfinite[i]), want, strict=True):
            assert torch.equal(got, expected.float()) or (got.isnan() and expected.isnan()), (
                i,
                got,
                expected,
            )
    assert float(nonfinite[5]) == 1 and float(nonfinite[6]) == 2


def test_reduced_then_finished_outliers_are_outlier_stats() -> None:
    x = torch.randn(3, 40, 32)
    x[2, 5, 7] = 300.0
    kept = reduce_outliers(x)
    assert kept is not None and reduce_outliers(torch.zeros(0, 8)) is None
    for a, b in zip(finish_outliers(kept), outlier_stats(x), strict=True):
        assert torch.equal(a, b)


def test_outliers_finished_together_are_those_finished_one_by_one() -> None:
    torch.manual_seed(1)
    states = [torch.randn(2, 80, 24) for _ in range(3)]
    states[1][0, 7, 5] = 500.0  # a massive activation in one of them
    states[2][..., 3] *= 40.0  # an outlier channel in another
    kept = [reduce_outliers(x) for x in states]
    assert all(k is not None for k in kept)
    together = finish_outliers_stacked(kept)  # type: ignore[arg-type]
    for i, k in enumerate(kept):
        for column, alone in zip(together, finish_outliers(k), strict=True):  # type: ignore[arg-type]
            torch.testing.assert_close(column[i], alone, rtol=1e-6, atol=0.0)
    assert float(together[1][1]) == 5.0 and float(together[0][1]) > 100


def test_deferred_activation_statistics_over_two_micro_batches_match_a_hand_computation() -> None:
    torch.manual_seed(0)
    model = reference_gpt()
    seen: list[torch.Tensor] = []
    model.blocks[0].register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    cfg = stabkit.MonitorConfig(every=1, console=False, audit=False, tensorboard=False, jsonl=False)
    mon = stabkit.attach(model, None, config=cfg)
    for micro in range(2):
        x, y = batch(micro)
        lm_loss(model(x), y).backward()
    mon.step()
    mon.flush()
    mon.detach()
    both = torch.stack(
        seen[-2:]
    )  # (2, ...) the block's output in each micro-batch (after attach's own probe forward)
    rms_each = both.flatten(1).pow(2).mean(1)  # mean square per micro-batch
    assert mon.metrics["act/blocks.0/rms"] == pytest.approx(math.sqrt(float(rms_each.mean())), rel=1e-5)
    assert mon.metrics["act/blocks.0/absmax"] == pytest.approx(float(both.abs().max()), rel=1e-6)
    assert mon.metrics["act/blocks.0/nonfinite"] == 0


@pytest.mark.parametrize(
    "target,probe,family",
    [
        ("stabkit.probes.activations.finish_tensors", "act", "act/blocks.0/rms"),
        ("stabkit.probes.outliers.finish_outliers_stacked", "outliers", "act/blocks.0/kurtosis"),
        ("stabkit.probes.attention.AttentionProbe._record", "attn", "attn/blocks.0.attn/max_logit"),
    ],
)
def test_a_deferred_finisher_that_raises_warns_once_and_training_goes_on(
    target: str, probe: str, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("finisher broke")

    monkeypatch.setattr(target, broken)
    torch.manual_seed(0)
    model = reference_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = stabkit.MonitorConfig(every=1, console=False, audit=False, tensorboard=False, jsonl=False)
    mon = stabkit.attach(model, opt, config=cfg)
    with pytest.warns(RuntimeWarning, match=f"probe '{probe}' failed at _finish") as caught:
        train_steps(model, opt, mon, 3)
    mon.flush()
    mon.detach()
    assert sum("failed at _finish" in str(w.message) for w in caught) == 1
    assert family not in mon.metrics and "grad/global_norm" in mon.metrics and len(mon.history) == 3
    model = reference_gpt()
    strict = stabkit.MonitorConfig(
        every=1, console=False, audit=False, tensorboard=False, jsonl=False, strict=True
    )
    mon = stabkit.attach(model, None, config=strict)
    x, y = batch(0)
    lm_loss(model(x), y).backward()
    with pytest.raises(ProbeError, match="finisher broke"):  # strict: the user chose to stop
        mon.step()
    mon.detach()
