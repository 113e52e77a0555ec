"""Vectors kept whole (`Recorder.add_vector`): a step's vectors are finished and committed as vectors
unless another record of one of their names comes in, and every value is the one per-name records
give, bit for bit.

- whole vectors (rms, mean, max, last) commit and drain exactly as the same values `add`ed one by one;
- a later `add` of a name held by a whole vector combines with it (the vector becomes slots);
- 'last' keeps the newer record either way; names repeated inside one vector (micro-batches finished
  together) combine;
- `commit`'s `StepValues` reads like a dict: membership, length, order (single records, then vectors).
"""

from __future__ import annotations

import pytest
import torch

from stabkit.stats import Recorder


def rng_values(k: int, seed: int) -> torch.Tensor:
    return torch.randn(k, generator=torch.Generator().manual_seed(seed)).abs() * 3


@pytest.mark.parametrize("combine", ["rms", "mean", "max", "last", "sum"])
def test_whole_vectors_commit_and_drain_bitwise_like_single_records(combine: str) -> None:
    names = tuple(f"act/m{i}/stat" for i in range(7))
    values = rng_values(7, 1)
    single, whole = Recorder(), Recorder()
    for rec in (single, whole):
        rec.add("loss", torch.tensor(2.5))
    for name, v in zip(names, values, strict=True):
        single.add(name, v, combine=combine)  # type: ignore[arg-type]
    whole.add_vector(names, values, combine=combine)  # type: ignore[arg-type]
    a, b = single.commit(3), whole.commit(3)
    assert list(b) == ["loss", *names] and len(b) == 8
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert single.drain() == whole.drain()


def test_an_add_after_a_whole_vector_combines_with_it() -> None:
    rec = Recorder()
    rec.add_vector(("a", "b"), torch.tensor([1.0, 5.0]), combine="max")
    assert float(rec.current("b")) == 5.0  # read: the vector is kept whole
    rec.add("a", torch.tensor(4.0), combine="max")
    rec.add("b", torch.tensor(2.0), combine="max")
    values = rec.commit(0)
    assert {k: float(v) for k, v in values.items()} == {"a": 4.0, "b": 5.0}


def test_rms_over_a_whole_vector_and_a_later_vector_of_the_same_names() -> None:
    rec = Recorder()
    rec.add_vector(("a", "b"), torch.tensor([3.0, 0.0]), combine="rms")
    rec.current_names()  # unpacked: whole
    rec.add_vector(("a", "b"), torch.tensor([4.0, 2.0]), combine="rms")
    values = rec.commit(0)
    assert float(values["a"]) == pytest.approx(((9 + 16) / 2) ** 0.5)
    assert float(values["b"]) == pytest.approx((4 / 2) ** 0.5)


def test_last_keeps_the_newer_record_whole_or_single() -> None:
    rec = Recorder()
    rec.add("a", torch.tensor(1.0))
    rec.add_vector(("a", "b"), torch.tensor([7.0, 8.0]))  # newer than the single 'a'
    assert float(rec.current("a")) == 7.0
    rec.add("b", torch.tensor(9.0))  # newer than the vector's 'b'
    values = rec.commit(0)
    assert {k: float(v) for k, v in values.items()} == {"a": 7.0, "b": 9.0}


def test_names_repeated_inside_one_vector_combine() -> None:
    rec = Recorder()
    rec.add_vector(("a", "b", "a"), torch.tensor([3.0, 1.0, 4.0]), combine="rms")
    values = rec.commit(0)
    assert float(values["a"]) == pytest.approx(((9 + 16) / 2) ** 0.5)
    assert float(values["b"]) == 1.0


def test_step_values_read_like_a_dict() -> None:
    rec = Recorder()
    rec.add("loss", torch.tensor(1.5))
    rec.add_vector(("x", "y"), torch.tensor([2.0, 3.0]), combine="max")
    values = rec.commit(0)
    assert "y" in values and "loss" in values and "z" not in values
    assert values.get("z") is None and float(values["y"]) == 3.0
    with pytest.raises(KeyError):
        values["z"]
    assert dict(values.items()).keys() == {"loss", "x", "y"}
    assert rec.drain() == [(0, {"loss": 1.5, "x": 2.0, "y": 3.0})]


@pytest.mark.parametrize("combine", ["rms", "mean", "max", "min", "sum", "last"])
def test_repeated_names_fold_inside_the_vector_like_single_records(combine: str) -> None:
    names = ("a", "b", "a", "c", "b", "a")  # a module called three times, one twice
    values = rng_values(6, 2)
    single, whole = Recorder(), Recorder()
    for name, v in zip(names, values, strict=True):
        single.add(name, v, combine=combine)  # type: ignore[arg-type]
    whole.add_vector(names, values, combine=combine)  # type: ignore[arg-type]
    assert whole.current_names() == ["a", "b", "c"]
    assert whole._whole, "folded, the vector stays whole"
    a, b = single.commit(0), whole.commit(0)
    for name in "abc":
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=0.0)
    (_, host_single), (_, host_whole) = single.drain()[0], whole.drain()[0]
    assert host_whole == pytest.approx(host_single, rel=1e-6)


@pytest.mark.parametrize("combine", ["rms", "mean"])
def test_a_folded_vector_counts_its_records_when_more_come(combine: str) -> None:
    rec = Recorder()
    rec.add_vector(("a", "a", "b"), torch.tensor([1.0, 2.0, 5.0]), combine=combine)  # type: ignore[arg-type]
    rec.current_names()  # unpacked: whole, 'a' standing for two records
    rec.add("a", torch.tensor(6.0), combine=combine)  # type: ignore[arg-type]
    rec.add_vector(("b", "b"), torch.tensor([7.0, 8.0]), combine=combine)  # type: ignore[arg-type]
    values = rec.commit(0)
    if combine == "mean":
        assert float(values["a"]) == pytest.approx((1 + 2 + 6) / 3)
        assert float(values["b"]) == pytest.approx((5 + 7 + 8) / 3)
    else:
        assert float(values["a"]) == pytest.approx(((1 + 4 + 36) / 3) ** 0.5)
        assert float(values["b"]) == pytest.approx(((25 + 49 + 64) / 3) ** 0.5)
