"""Predict before scaling up: fit how the max attention logit grows with peak LR and width, and
extrapolate the LR at which a wider model crosses a threshold (Wortsman et al. 2023 §3.4, Fig. 9:
every run whose max logit passed 1e4 diverged; a fit on small models predicted the LR at which a
4.8 B model without qk-layernorm diverges).

The law fitted (ordinary least squares on the points in the growth regime, ``max logit >= floor``):

    log10 z = a + b·x + c·u + d·x·u,    x = log10 LR,  u = log10 width

so every width has its own straight line in log-log (slope b + d·u), and slope and offset change
linearly in log10 width. The LR at which width W crosses the threshold θ solves the law for x:

    x*(W) = (log10 θ − a − c·u) / (b + d·u),   u = log10 W

Its uncertainty comes from the fit: parameter draws from the least-squares covariance (a
multivariate t with the residuals' degrees of freedom) give a distribution of x*; the 5th-95th percentiles are reported.
A draw whose slope at W is not positive has no crossing (counted). Pure numpy: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

THRESHOLD = 1e4
"""Wortsman et al.: every run with a max attention logit above 1e4 diverged."""
FLOOR = 50.0
"""Points below this max logit are not in the growth regime (init level ~5) and are left out."""
DRAWS = 4000
MIN_RUNS = 7
"""Runs in the growth regime a fit needs: 4 parameters and 3 degrees of freedom for the residuals."""


@dataclass
class Point:
    """One run: width, peak LR, max attention logit over the run."""

    width: int
    lr: float
    max_logit: float


@dataclass
class LawFit:
    """The fitted law and what it predicts at one width."""

    params: list[float]
    """a, b, c, d of log10 z = a + b·x + c·u + d·x·u."""
    covariance: list[list[float]]
    residual_std: float
    """Root-mean-square residual (decades of max logit), with the degrees of freedom."""
    points: int
    dof: int
    """Degrees of freedom of the residuals (points − 4)."""
    widths: list[int]
    threshold: float
    floor: float

    def log_logit(self, width: float, lr: float) -> float:
        """The law's log10 max logit at (width, lr)."""
        a, b, c, d = self.params
        x, u = math.log10(lr), math.log10(width)
        return a + b * x + c * u + d * x * u

    def slope(self, width: float) -> float:
        """d log10 z / d log10 LR at `width`."""
        return self.params[1] + self.params[3] * math.log10(width)

    def crossing(self, width: float) -> float | None:
        """The LR at which `width` crosses the threshold (None when the slope is not positive)."""
        return crossing_lr(np.asarray(self.params), width, self.threshold)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def crossing_lr(params: np.ndarray, width: float, threshold: float) -> float | None:
    """The LR at which the law `params` reaches `threshold` at `width`: None when the slope there is
    not positive, inf when the crossing lies beyond any float (a slope near 0)."""
    a, b, c, d = (float(v) for v in params)
    u = math.log10(width)
    slope = b + d * u
    if not slope > 0:
        return None
    exponent = (math.log10(threshold) - a - c * u) / slope
    return 10**exponent if exponent < 300 else math.inf


def fit_law(points: Sequence[Point], threshold: float = THRESHOLD, floor: float = FLOOR) -> LawFit:
    """Least squares of the law on the points with ``floor <= max logit`` (finite). Raises
    ValueError when fewer than `MIN_RUNS` such points or fewer than 2 widths remain (4 parameters
    and at least 3 degrees of freedom left for the residuals, or the interval means nothing)."""
    used = [p for p in points if math.isfinite(p.max_logit) and p.max_logit >= floor and p.lr > 0]
    widths = sorted({p.width for p in used})
    if len(used) < MIN_RUNS or len(widths) < 2:
        raise ValueError(
            f"the law needs at least {MIN_RUNS} runs in the growth regime (max logit >= {floor:g}) over at least 2 "
            f"widths, got {len(used)} over {len(widths)}: widen the LR grid upwards"
        )
    x = np.log10([p.lr for p in used])
    u = np.log10([p.width for p in used])
    y = np.log10([p.max_logit for p in used])
    design = np.stack([np.ones_like(x), x, u, x * u], axis=1)
    params, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ params
    dof = max(1, len(y) - 4)
    sigma2 = float(resid @ resid) / dof
    cov = sigma2 * np.linalg.pinv(design.T @ design)
    return LawFit(
        params=[float(v) for v in params],
        covariance=[[float(v) for v in row] for row in cov],
        residual_std=math.sqrt(sigma2),
        points=len(used),
        dof=dof,
        widths=widths,
        threshold=threshold,
        floor=floor,
    )


@dataclass
class Prediction:
    """The predicted crossing LR at a width, with its interval."""

    width: int
    lr: float | None
    """The law's crossing LR (None: the fitted slope there is not positive: no crossing; inf: beyond
    any float)."""
    low: float | None
    """5th percentile over parameter draws (draws without a crossing left out)."""
    high: float | None
    """95th percentile."""
    no_crossing: float
    """Fraction of draws whose slope at this width is not positive (or that cross beyond any float)."""
    extrapolated: bool
    """The width lies outside the fitted widths."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parameter_draws(fit: LawFit, draws: int = DRAWS, seed: int = 0) -> np.ndarray:
    """(draws, 4) parameter vectors from the fit's multivariate t distribution (few runs: the
    residual variance is itself uncertain, so a t with the fit's degrees of freedom, not a normal)."""
    rng = np.random.default_rng(seed)
    normal = rng.multivariate_normal(np.zeros(4), np.asarray(fit.covariance), size=draws)
    scale = np.sqrt(rng.chisquare(fit.dof, size=draws) / fit.dof)
    return np.asarray(fit.params) + normal / scale[:, None]


def predict(fit: LawFit, width: int, draws: int = DRAWS, seed: int = 0) -> Prediction:
    """The crossing LR at `width` and its 90 % interval from parameter draws."""
    samples = parameter_draws(fit, draws, seed)
    lrs = [crossing_lr(s, width, fit.threshold) for s in samples]
    found = np.array([v for v in lrs if v is not None and math.isfinite(v)])
    low = high = None
    if found.size:
        low, high = (float(v) for v in np.quantile(found, [0.05, 0.95]))
    return Prediction(
        width=width,
        lr=fit.crossing(width),
        low=low,
        high=high,
        no_crossing=1.0 - found.size / draws,
        extrapolated=not (min(fit.widths) <= width <= max(fit.widths)),
    )


def measured_crossing(curve: Sequence[tuple[float, float]], threshold: float = THRESHOLD) -> float | None:
    """The LR at which a measured (LR, max logit) curve first reaches `threshold`, interpolated in
    log-log between the grid points around it; None when it never does. When the lowest LR is
    already above, that LR (an upper bound)."""
    pts = sorted((lr, z) for lr, z in curve if lr > 0 and math.isfinite(z) and z > 0)
    for i, (lr, z) in enumerate(pts):
        if z < threshold:
            continue
        if i == 0:
            return lr
        lr0, z0 = pts[i - 1]
        t = (math.log10(threshold) - math.log10(z0)) / (math.log10(z) - math.log10(z0))
        return 10 ** (math.log10(lr0) + t * (math.log10(lr) - math.log10(lr0)))
    return None


@dataclass
class Check:
    """An honest test of the extrapolation: the prediction for a width not in the fit, the crossing
    measured there, and the error."""

    prediction: Prediction
    measured: float | None
    error_decades: float | None
    """log10(predicted / measured): > 0 predicted too high an LR (too optimistic)."""
    inside_interval: bool | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check(prediction: Prediction, measured: float | None) -> Check:
    """Compare a prediction with the crossing measured at its width."""
    if prediction.lr is None or not math.isfinite(prediction.lr) or measured is None:
        note = "no crossing measured on the grid" if measured is None else "no crossing predicted"
        return Check(prediction, measured, None, None, [note])
    err = math.log10(prediction.lr / measured)
    inside = (
        None
        if prediction.low is None or prediction.high is None
        else prediction.low <= measured <= prediction.high
    )
    return Check(prediction, measured, err, inside)
