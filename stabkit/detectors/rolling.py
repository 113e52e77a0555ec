"""`RollingWindow`: the last n host floats of one series, with O(1) mean/std and robust median/MAD.

Used by the host-side detectors when they consume a value (at the log interval, or every step
when an action needs a per-step decision). Pure Python; checkpointable.
"""

from __future__ import annotations

import math
import operator
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

    def __len__(self) -> int:
        return len(self.values)

    def push(self, x: float) -> None:
        """Append `x` (dropping the oldest when full)."""
        if len(self.values) == self.size:
            old = self.values[0]
            self._sum -= old
            self._sq -= old * old
            self._nans -= old != old
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
        diffs = list(map(operator.sub, values[1:], values[:-1]))  # b − a of each successive pair
        if len(diffs) < 2:
            return level, around
        mid = median_sorted(sorted(diffs))
        steps = MAD_TO_SIGMA * median_sorted(sorted(map(abs, map(mid.__rsub__, diffs)))) / math.sqrt(2.0)
        return level, max(steps, around)

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
