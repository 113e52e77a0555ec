"""The width-scaling law (Wortsman et al. 2023 §3.4): checked on synthetic runs drawn from a known
law — the fit recovers it, the crossing LR it extrapolates matches the one solved by hand, and the
90 % interval covers the truth about 90 % of the time."""

from __future__ import annotations

import math

import numpy as np
import pytest

from stabkit.harness.recipes.science.scaling import (
    LawFit,
    Point,
    check,
    fit_law,
    measured_crossing,
    predict,
)

LAW = (3.0, 2.0, 1.0, 0.4)  # a, b, c, d of log10 z = a + b x + c u + d x u
WIDTHS = (32, 64, 128)
LRS = (1e-2, 3e-2, 1e-1, 3e-1, 1.0)


def law_log(width: float, lr: float, law: tuple[float, ...] = LAW) -> float:
    a, b, c, d = law
    x, u = math.log10(lr), math.log10(width)
    return a + b * x + c * u + d * x * u


def true_crossing(width: float, threshold: float = 1e4, law: tuple[float, ...] = LAW) -> float:
    a, b, c, d = law
    u = math.log10(width)
    return 10 ** ((math.log10(threshold) - a - c * u) / (b + d * u))


def runs(noise: float = 0.0, seed: int = 0, law: tuple[float, ...] = LAW) -> list[Point]:
    rng = np.random.default_rng(seed)
    return [Point(w, lr, 10 ** (law_log(w, lr, law) + rng.normal(0, noise))) for w in WIDTHS for lr in LRS]


def test_noise_free_runs_give_the_law_back_and_its_crossing() -> None:
    fit = fit_law(runs(), floor=1.0)
    assert fit.params == pytest.approx(LAW, abs=1e-9)
    assert fit.residual_std == pytest.approx(0.0, abs=1e-9)
    # d256 by hand: u = 2.408; x* = (4 - 3 - 2.408) / (2 + 0.963) = -0.4752 -> LR 0.3348
    assert true_crossing(256) == pytest.approx(0.3348, abs=1e-4)
    assert fit.crossing(256) == pytest.approx(true_crossing(256), rel=1e-9)


def test_the_interval_covers_the_truth_about_nine_times_in_ten() -> None:
    truth = true_crossing(256)
    hits, errors = 0, []
    for rep in range(120):
        fit = fit_law(runs(noise=0.1, seed=rep), floor=1.0)
        pred = predict(fit, 256, draws=800, seed=rep)
        assert pred.low is not None and pred.high is not None and pred.lr is not None
        assert pred.extrapolated
        hits += pred.low <= truth <= pred.high
        errors.append(abs(math.log10(pred.lr / truth)))
    assert 0.8 <= hits / 120 <= 0.97
    assert float(np.median(errors)) < 0.08  # decades: 0.1-decade noise on 15 runs


def test_runs_below_the_floor_are_left_out_of_the_fit() -> None:
    flat = [Point(w, 1e-4, 5.0) for w in WIDTHS]  # the init level: no growth there
    fit = fit_law(runs() + flat, floor=50.0)
    assert fit.points == sum(10 ** law_log(w, lr) >= 50 for w in WIDTHS for lr in LRS)
    assert fit.crossing(256) == pytest.approx(true_crossing(256), rel=1e-6)


def test_too_few_growing_runs_is_an_error_that_says_what_to_do() -> None:
    with pytest.raises(ValueError, match="at least 7 runs .* widen the LR grid"):
        fit_law([Point(32, 0.1, 100.0), Point(64, 0.1, 200.0), Point(64, 0.3, 900.0)])


def test_a_law_that_does_not_grow_with_lr_never_crosses() -> None:
    flat = (2.0, -0.1, 0.1, 0.0)  # max logit falls with LR (a qk-normed model stays bounded)
    fit = fit_law(runs(noise=0.01, law=flat), floor=1.0)
    assert fit.crossing(256) is None
    pred = predict(fit, 256)
    assert pred.lr is None and pred.no_crossing > 0.9
    result = check(pred, measured=None)
    assert result.error_decades is None and result.notes


def test_measured_crossing_interpolates_in_log_log() -> None:
    # 1e3 at 0.1, 1e5 at 0.3: 1e4 is half way in log10 z, so half way in log10 LR: sqrt(0.03)
    curve = [(0.03, 20.0), (0.1, 1e3), (0.3, 1e5), (1.0, 1e7)]
    assert measured_crossing(curve) == pytest.approx(math.sqrt(0.03), rel=1e-12)
    assert measured_crossing([(0.1, 5.0), (0.3, 50.0)]) is None
    assert measured_crossing([(0.1, 2e4), (0.3, 5e4)]) == 0.1  # already over at the lowest LR


def test_the_check_reports_the_error_in_decades() -> None:
    fit = LawFit(
        params=list(LAW), covariance=(np.eye(4) * 1e-4).tolist(), residual_std=0.01, points=12, dof=8,
        widths=list(WIDTHS), threshold=1e4, floor=50.0,
    )  # fmt: skip
    pred = predict(fit, 256)
    assert pred.lr == pytest.approx(true_crossing(256))
    result = check(pred, measured=pred.lr / 2)
    assert result.error_decades == pytest.approx(math.log10(2))


def test_a_slope_near_zero_crosses_beyond_any_float_without_an_error() -> None:
    # what a qk-normed model's four growing runs gave: the slope is positive but tiny, and
    # 10 ** (huge exponent) would overflow
    fit = LawFit(
        params=[1.0, 1e-6, 0.1, 0.0], covariance=(np.eye(4) * 1e-14).tolist(), residual_std=0.01, points=5,
        dof=1, widths=[32, 64, 128], threshold=1e4, floor=50.0,
    )  # fmt: skip
    assert fit.crossing(256) == math.inf
    pred = predict(fit, 256)
    assert pred.lr == math.inf and pred.no_crossing == 1.0 and pred.low is None
    result = check(pred, measured=0.1)
    assert result.error_decades is None and result.notes == ["no crossing predicted"]
