"""`RollingWindow`: the last n host floats of one series, with O(1) mean/std and robust median/MAD.

Used by the host-side detectors when they consume a value (at the log interval, or every step
when an action needs a per-step decision). Pure Python; checkpointable.

The spike detectors ask every watched series, for every row, for the scatter of the window's
successive differences (`RollingWindow.recent_level_noise`): the differences are kept sorted as
values come and go (`bisect`), and their median absolute deviation is selected from them in
O(log n) (`_kth_deviation`) instead of re-sorting the 127 differences of a 128-value window twice per
value — the largest item of a log interval's host work on a small step before.
"""

from __future__ import annotations

import math
import operator
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Iterable
from typing import Any

MAD_TO_SIGMA = 1.4826
"""1 / Φ⁻¹(3/4): scales the median absolute deviation to σ for Gaussian data."""


class RollingWindow:
    """The newest `size` values; running sums for mean/std (re-summed every `size` pushes)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.values: deque[float] = deque(maxlen=size)
        self._sum = 0.0
        self._sq = 0.0
        self._pushes = 0
        self._nans = 0
        """NaN values in the window, kept as values come and go (no scan per question)."""
        self._diffs: list[float] | None = []
        """The window's successive differences (b − a of each neighbouring pair), sorted, kept as
        values come and go; None: to be rebuilt from the values when next asked (after a NaN, a
        rollback or a restore)."""

    def __len__(self) -> int:
        return len(self.values)

    def push(self, x: float) -> None:
        """Append `x` (dropping the oldest when full)."""
        values = self.values
        diffs = self._diffs
        if len(values) == self.size:
            old = values[0]
            self._sum -= old
            self._sq -= old * old
            self._nans -= old != old
            if diffs is not None and len(values) > 1:
                gone = values[1] - old
                i = bisect_left(diffs, gone)
                if i < len(diffs) and diffs[i] == gone:
                    del diffs[i]
                else:  # a NaN difference (never kept): rebuild when asked
                    self._diffs = diffs = None
        if diffs is not None and values and self.size > 1:  # the newest value stays beside `x`
            new = x - values[-1]
            if new == new:
                insort(diffs, new)
            else:
                self._diffs = None
        self._nans += x != x
        self.values.append(x)
        self._sum += x
        self._sq += x * x
        self._pushes += 1
        if self._pushes % self.size == 0:  # bound the drift of the running sums
            self._sum = math.fsum(self.values)
            self._sq = math.fsum(v * v for v in self.values)

    def drop_newest(self, n: int) -> None:
        """Forget the `n` newest values (a rollback undid the steps that pushed them)."""
        for _ in range(min(n, len(self.values))):
            self.values.pop()
        self._diffs = None
        self._nans = sum(v != v for v in self.values)
        self._sum = math.fsum(self.values)
        self._sq = math.fsum(v * v for v in self.values)

    def mean_std(self) -> tuple[float, float]:
        """Mean and (population) standard deviation of the window."""
        n = len(self.values)
        if n == 0:
            return math.nan, math.nan
        mean = self._sum / n
        var = max(self._sq / n - mean * mean, 0.0)
        return mean, math.sqrt(var)

    def median_sigma(self) -> tuple[float, float]:
        """Median and robust σ (1.4826 × median absolute deviation) of the window."""
        if not self.values or self._nans:  # numpy's answer for NaN
            return math.nan, math.nan
        med = median_sorted(sorted(self.values))
        return med, MAD_TO_SIGMA * median_sorted(sorted(map(abs, map(med.__rsub__, self.values))))

    def recent_level_noise(self, recent: int) -> tuple[float, float]:
        """(level, noise σ) of the window for judging its next value against the run's recent trend:

        - level: the median of the newest `recent` values (it follows a falling loss within
          ~recent/2 steps, where the median of a long window still holds values from far above);
        - noise σ: the larger of two robust scatters — 1.4826 × the median absolute deviation of the
          window's successive differences, divided by √2 (the step-to-step scatter with the trend
          taken out: a steady descent moves every difference alike, one earlier spike makes two
          outlying differences the median ignores), and 1.4826 × the MAD of the newest `recent`
          values (the scatter around the level, which a series alternating between two values has
          and its differences hide).

        NaN when a value is NaN (numpy's answer)."""
        if not self.values or self._nans:
            return math.nan, math.nan
        values = list(self.values)
        # map over builtins instead of generator expressions: the same floats, ~2x faster (this runs
        # for every watched series of every row, at each log interval)
        newest = sorted(values[-recent:])
        level = median_sorted(newest)
        around = MAD_TO_SIGMA * median_sorted(sorted(map(abs, map(level.__rsub__, newest))))
        diffs = self._sorted_diffs()
        if len(diffs) < 2:
            return level, around
        mid = median_sorted(diffs)
        steps = MAD_TO_SIGMA * median_deviation(diffs, mid) / math.sqrt(2.0)
        return level, max(steps, around)

    def _sorted_diffs(self) -> list[float]:
        """The window's successive differences, sorted (rebuilt here when they were dropped)."""
        if self._diffs is None:
            values = list(self.values)
            self._diffs = sorted(map(operator.sub, values[1:], values[:-1]))  # b − a of each pair
        return self._diffs

    def state_dict(self) -> dict[str, Any]:
        """Plain, JSON-ready state."""
        return {"size": self.size, "values": list(self.values), "pushes": self._pushes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()` output (the window size must match)."""
        if int(state["size"]) != self.size:
            raise ValueError(
                f"rolling window size changed: checkpoint has {state['size']}, config has {self.size}"
            )
        self.values = deque((float(v) for v in state["values"]), maxlen=self.size)
        self._diffs = None
        self._nans = sum(v != v for v in self.values)
        self._sum = math.fsum(self.values)
        self._sq = math.fsum(v * v for v in self.values)
        self._pushes = int(state["pushes"])


def median_sorted(ordered: list[float]) -> float:
    """Median of a sorted list, as ``numpy.median`` gives it (the mean of the two middle values of an
    even count). Sorting ≤ a few hundred floats in Python is ~3× faster than numpy's median there,
    which the spike detectors ask for every watched series at every consumed step."""
    n = len(ordered)
    return ordered[n // 2] if n % 2 else (ordered[n // 2 - 1] + ordered[n // 2]) / 2


def median_deviation(ordered: list[float], center: float) -> float:
    """Median of ``|x − center|`` over the sorted list `ordered` (numpy's median: the mean of the two
    middle values of an even count), the same floats as sorting the deviations: those below `center`
    and those at or above it are each already in order, so the middle ones are selected from the two
    runs (`_kth_deviation`) in O(log n)."""
    n = len(ordered)
    split = bisect_left(ordered, center)
    if n % 2:
        return _kth_deviation(ordered, center, split, n // 2)
    return (
        _kth_deviation(ordered, center, split, n // 2 - 1) + _kth_deviation(ordered, center, split, n // 2)
    ) / 2


def _kth_deviation(ordered: list[float], center: float, split: int, k: int) -> float:
    """The `k`-th smallest (from 0) of ``|x − center|`` over sorted `ordered`, whose first `split`
    values are below `center`: the deviations ``center − ordered[split−1−i]`` (left run, i = 0..) and
    ``ordered[split+j] − center`` (right run) each increase, so take i from the left and k+1−i from
    the right for the smallest i whose next left deviation is not below the right run's last taken."""
    n_left, n_right = split, len(ordered) - split
    lo, hi = max(0, k + 1 - n_right), min(k + 1, n_left)
    while lo < hi:
        i = (lo + hi) // 2
        if center - ordered[split - 1 - i] < ordered[split + k - i] - center:
            lo = i + 1
        else:
            hi = i
    taken_right = k + 1 - lo
    left = center - ordered[split - lo] if lo else -math.inf
    right = ordered[split + taken_right - 1] - center if taken_right else -math.inf
    return max(left, right)


def loss_falls(losses: Iterable[tuple[int, float]], start: int, end: int) -> bool | None:
    """Whether the loss fell over steps `start`..`end` of `losses` ((step, loss) pairs): the median of
    the last third of its values there below the median of the first third (None: fewer than 6
    values). How the drift and router-z detectors grade a rise: a note while the loss still falls."""
    values = [v for t, v in losses if start <= t <= end]
    if len(values) < 6:
        return None
    third = len(values) // 3
    return median_sorted(sorted(values[-third:])) < median_sorted(sorted(values[:third]))


def grade_by_loss(losses: Iterable[tuple[int, float]], start: int, end: int, danger: str) -> tuple[str, str]:
    """('info' | 'warning', the reason in words) of a rise still short of its danger line: a note while
    the loss falls over `start`..`end` (`loss_falls`), a warning once it stalls or is not known to
    fall. `danger` says where the warning line is ("past 12.5", "6 nats above the start")."""
    falling = loss_falls(losses, start, end)
    if falling is None:
        return "warning", "— the loss is not known to be falling"
    if not falling:
        return "warning", "— and the loss has stopped falling"
    return "info", f"while the loss still falls (a note: a warning {danger} or once the loss stalls)"
