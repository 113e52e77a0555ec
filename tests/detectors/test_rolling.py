"""`RollingWindow`'s robust statistics against numpy on the same values, and its NaN bookkeeping
(kept as values come and go) against a scan of the window."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from stabkit.detectors.rolling import MAD_TO_SIGMA, RollingWindow, median_deviation, median_sorted


def _expected(values: list[float], recent: int) -> tuple[float, float]:
    """`recent_level_noise` computed with numpy (the definition in its docstring)."""
    v = np.asarray(values)
    newest = v[-recent:]
    level = float(np.median(newest))
    around = MAD_TO_SIGMA * float(np.median(np.abs(newest - level)))
    diffs = np.diff(v)
    if len(diffs) < 2:
        return level, around
    steps = MAD_TO_SIGMA * float(np.median(np.abs(diffs - np.median(diffs)))) / math.sqrt(2.0)
    return level, max(steps, around)


@pytest.mark.parametrize("seed", range(4))
def test_level_noise_and_median_sigma_equal_numpy(seed: int) -> None:
    rng = random.Random(seed)
    window = RollingWindow(32)
    pushed: list[float] = []
    for _ in range(80):  # past the window's size: old values leave
        x = rng.lognormvariate(0, 1)
        window.push(x)
        pushed.append(x)
        kept = pushed[-32:]
        level, noise = window.recent_level_noise(8)
        want_level, want_noise = _expected(kept, 8)
        assert level == pytest.approx(want_level, rel=1e-12)
        assert noise == pytest.approx(want_noise, rel=1e-12)
        med, sigma = window.median_sigma()
        assert med == pytest.approx(float(np.median(kept)), rel=1e-12)
        assert sigma == pytest.approx(
            MAD_TO_SIGMA * float(np.median(np.abs(np.asarray(kept) - med))), rel=1e-12
        )


def test_a_nan_counts_while_it_is_in_the_window_and_not_after() -> None:
    window = RollingWindow(4)
    for x in (1.0, 2.0, math.nan, 3.0):
        window.push(x)
    assert all(math.isnan(v) for v in window.recent_level_noise(2))
    assert all(math.isnan(v) for v in window.median_sigma())
    for x in (4.0, 5.0, 6.0):  # the NaN leaves after the third push
        window.push(x)
    assert not any(math.isnan(v) for v in window.median_sigma())
    assert window.median_sigma()[0] == 4.5


def test_nan_bookkeeping_survives_drop_and_restore() -> None:
    window = RollingWindow(5)
    for x in (1.0, 2.0, 3.0, math.nan):
        window.push(x)
    window.drop_newest(1)  # a rollback takes the NaN back
    assert window.median_sigma()[0] == 2.0
    window.push(math.nan)
    restored = RollingWindow(5)
    restored.load_state_dict(window.state_dict())
    assert all(math.isnan(v) for v in restored.median_sigma())


def _sorted_reference(values: list[float], recent: int) -> tuple[float, float]:
    """`recent_level_noise` as it was written before the differences were kept sorted: every list
    re-sorted per question (the same floats are expected, bit for bit)."""
    newest = sorted(values[-recent:])
    level = median_sorted(newest)
    around = MAD_TO_SIGMA * median_sorted(sorted(abs(v - level) for v in newest))
    diffs = [b - a for a, b in itertools.pairwise(values)]
    if len(diffs) < 2:
        return level, around
    mid = median_sorted(sorted(diffs))
    steps = MAD_TO_SIGMA * median_sorted(sorted(abs(d - mid) for d in diffs)) / math.sqrt(2.0)
    return level, max(steps, around)


@pytest.mark.parametrize("seed", range(6))
def test_median_deviation_selects_what_sorting_the_deviations_gives(seed: int) -> None:
    rng = random.Random(seed)
    for n in range(1, 60):
        draw = rng.choice([lambda: rng.gauss(0, 1), lambda: float(rng.randint(-3, 3)), lambda: 1.5])
        ordered = sorted(draw() for _ in range(n))  # ties, a constant list, negatives
        for center in (median_sorted(ordered), ordered[0], ordered[-1], rng.uniform(-5, 5)):
            want = median_sorted(sorted(abs(x - center) for x in ordered))
            assert median_deviation(ordered, center) == want, (ordered, center)


@pytest.mark.parametrize(("seed", "size"), [(0, 16), (1, 16), (2, 16), (3, 16), (4, 1), (5, 2), (6, 3)])
def test_kept_sorted_differences_follow_pushes_nans_rollbacks_and_restores(seed: int, size: int) -> None:
    rng = random.Random(seed)
    window = RollingWindow(size)
    pushed: list[float] = []
    for t in range(300):
        roll = rng.random()
        if roll < 0.03:
            x = math.nan
        elif roll < 0.3:
            x = float(rng.randint(0, 4))  # repeated values and zero differences
        else:
            x = rng.lognormvariate(0, 1)
        window.push(x)
        pushed.append(x)
        if t % 37 == 36:  # a rollback takes values back
            window.drop_newest(3)
            del pushed[-3:]
        if t % 53 == 52:  # a restore from a checkpoint
            restored = RollingWindow(size)
            restored.load_state_dict(window.state_dict())
            window = restored
        kept = pushed[len(pushed) - len(window) :]  # after a rollback the window holds fewer values
        got = window.recent_level_noise(5)
        if not kept or any(math.isnan(v) for v in kept):
            assert all(math.isnan(v) for v in got)
        else:
            assert got == _sorted_reference(kept, 5)
            assert len(window._sorted_diffs()) == max(len(kept) - 1, 0)
