"""stabkit's own time per step: a timer around each hook the monitor registered, the gradient
probe's end-of-backward callback, the attention probe's measurement (inside the attention module's
forward) and `Monitor.step` (`stabkit bench --in-hook`); and, apart, the log interval's flush (the host copy,
the detectors' judgement of the rows, the sinks' writes), which one step in `log_every` pays and a
median over steps never shows; and, on unsampled steps, how much of that time is the torch ops
those calls make (each timed around its dispatch, `torch_ops_ms`) and how much stabkit's Python.

The ratio and the "+ms" columns say what a monitor costs a loop, with the machine's noise in them;
this says where a step's time inside stabkit goes, per entry point, to the tens of microseconds. It
counts everything that runs inside those calls — Python and the kernels of the statistics they take
(on an unsampled step: the gradient norms' one `_foreach_norm`) — and not what a hook costs torch to
dispatch (~1 µs a hook on a CPU) or what the model's kernels lose to caches stabkit touched. The
timer adds ~1 µs a call of its own.

When it runs: after the timed rounds, on a fresh model per monitored variant (the timed monitors are
never wrapped), for `STEPS` steps after a warm-up and on to `SAMPLED` sampled ones (at most
`EXTRA_STEPS` more); the text says how many steps each median holds.
"""

from __future__ import annotations

import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch.utils._python_dispatch import TorchDispatchMode

from ..attaching import attach

if TYPE_CHECKING:
    from ..monitor import Monitor
    from .runner import BenchConfig

STEPS = 60
"""Timed steps per variant at least (six default sampling cycles)."""
SAMPLED = 12
"""Sampled steps the timer goes on to, past `STEPS`, for a median that is a reading (six at
``every=10`` moved by several ms between runs), within `EXTRA_STEPS` more steps."""
EXTRA_STEPS = 120
"""At most this many steps past `STEPS` for `SAMPLED` (``every=100`` gets one or two)."""
PROFILED = 20
"""Unsampled steps run with stabkit's torch ops timed, after the timed ones, for the Python / torch-op
split (`torch_ops_ms`)."""

MEASURED_INSIDE_FORWARD = ("_measure",)
"""Probe methods that run inside a module's forward rather than in a hook (the attention probe's
measurement, from its handler of the attention call under the scope's torch-function mode): timed
as entry points of their own, so a sampled step's attention statistics are counted."""


@dataclass
class InHook:
    """Median milliseconds inside stabkit per sampled and per unsampled step, and per entry point."""

    sampled_ms: float | None
    unsampled_ms: float | None
    top: dict[str, float] = field(default_factory=dict)
    """Median ms per step of each entry point (hook function), largest first: over the unsampled
    steps, or the sampled ones when every step is sampled (`top_of`)."""
    top_of: str = "unsampled"
    flush_ms: float | None = None
    """Median milliseconds of a log interval's flush (`Monitor.flush` inside `Monitor.step`), None
    when none was timed."""
    log_every: int | None = None
    """The rows (steps) one flush writes: its cost a step is ``flush_ms / log_every``."""
    sampled_steps: int = 0
    """Sampled steps behind `sampled_ms`."""
    unsampled_steps: int = 0
    """Unsampled steps behind `unsampled_ms`."""
    python_ms: float | None = None
    """stabkit's own Python per unsampled step: `unsampled_ms` less `ops_ms` (None when not split)."""
    ops_ms: float | None = None
    """Median milliseconds per unsampled step of the torch ops stabkit's entry points call, each timed
    around its dispatch (`torch_ops_ms`): their kernels on a CPU, their launches on a GPU."""

    def text(self, name: str) -> str:
        def ms(x: float | None) -> str:
            return "-" if x is None else f"{x:.3f} ms"

        parts = ", ".join(f"{k} {v:.3f}" for k, v in list(self.top.items())[:5])
        flush = ""
        if self.flush_ms is not None and self.log_every:
            flush = (
                f"; log interval: {self.flush_ms:.2f} ms a flush of {self.log_every} rows "
                f"({self.flush_ms / self.log_every:.3f} ms a step)"
            )
        split = ""
        if self.python_ms is not None and self.ops_ms is not None:
            split = f" (Python {self.python_ms:.3f} ms, torch ops {self.ops_ms:.3f} ms)"
        return (
            f"in stabkit, {name}: {ms(self.unsampled_ms)} per unsampled step (median of "
            f"{self.unsampled_steps}){split}, {ms(self.sampled_ms)} per sampled step (median of "
            f"{self.sampled_steps}); {self.top_of}, by entry point (ms): {parts or '-'}{flush}"
        )


class _Clock:
    """Seconds spent inside wrapped calls this step, per entry point: a call made inside another
    wrapped one counts for its own entry point, not for the outer one's (each second counts once)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self._inner: list[float] = []
        """Per wrapped call in progress, outermost first: seconds its wrapped inner calls took."""

    def busy(self) -> bool:
        """Whether a wrapped call is in progress (the code running now is stabkit's)."""
        return bool(self._inner)

    def wrap(self, fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._inner.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                own = elapsed - self._inner.pop()
                self.spent[key] = self.spent.get(key, 0.0) + own
                if self._inner:
                    self._inner[-1] += elapsed

        return timed


def _name(fn: Any) -> str:
    inner = getattr(fn, "fn", fn)  # AfterClosure keeps the optimizer hook in .fn
    return str(getattr(inner, "__qualname__", type(inner).__name__)).replace(".<locals>", "")


def wrap_monitor(mon: Monitor, clock: _Clock) -> None:
    """Put `clock` around every hook in ``mon.hooks`` and the gradient probe's callback."""
    for _, _, handle in getattr(mon.hooks, "_handles", []):
        hooks = handle.hooks_dict_ref()
        if hooks is not None and handle.id in hooks:
            hooks[handle.id] = clock.wrap(hooks[handle.id], _name(hooks[handle.id]))
    for probe in mon.probes:
        callback = getattr(probe, "_after_backward", None)
        if callback is not None:  # queued by name at each backward: an instance attribute wins
            probe._after_backward = clock.wrap(callback, "GradProbe._after_backward")  # type: ignore[attr-defined]
        for method in MEASURED_INSIDE_FORWARD:
            inner = getattr(probe, method, None)
            if inner is not None:  # called by name from a handler inside the module's forward
                setattr(probe, method, clock.wrap(inner, f"{type(probe).__name__}.{method}"))


def measure(cfg: BenchConfig, variant: str) -> InHook:
    """stabkit's time per step for monitored `variant` on a fresh model of `cfg`."""
    from .runner import _Trainer, make_batches, monitor_config

    mcfg = monitor_config(variant)
    assert mcfg is not None
    tr = _Trainer(cfg, make_batches(cfg))
    clock = _Clock()
    flushes: list[float] = []
    with tempfile.TemporaryDirectory(prefix="stabkit-inhook-") as tmp:
        mon = tr.monitor = attach(tr.model, tr.opt, logdir=tmp, config=mcfg)
        try:
            wrap_monitor(mon, clock)
            step = clock.wrap(mon.step, "Monitor.step")
            mon.step = step  # type: ignore[method-assign]
            tr.run(max(cfg.warmup, 2))
            mon.flush = _timed(mon.flush, flushes)  # type: ignore[method-assign]
            rows: list[tuple[bool, dict[str, float]]] = []
            while len(rows) < STEPS or (
                sum(s for s, _ in rows) < SAMPLED and len(rows) < STEPS + EXTRA_STEPS
            ):
                sampled = mon.global_step % mon.config.every == 0
                clock.spent = {}
                tr.run(1)
                rows.append((sampled, dict(clock.spent)))
            for _ in range(mon.config.log_every):  # no log interval ended in the window: go to the next
                if flushes:
                    break
                tr.run(1)
            del mon.flush  # detach's own flush is not a log interval's
            ops = torch_ops_ms(mon, tr.run, clock)
        finally:
            mon.detach()
    summary = _summary(rows)
    if ops is not None and summary.unsampled_ms is not None:
        summary.ops_ms = ops
        summary.python_ms = max(0.0, summary.unsampled_ms - ops)
    if flushes:
        summary.flush_ms = 1e3 * statistics.median(flushes)
        summary.log_every = mcfg.log_every
    return summary


class _OpTimer(TorchDispatchMode):
    """Seconds of the torch ops called while `inside()` is true (stabkit's entry points), each timed
    around its own dispatch below this mode; other ops pass through untimed."""

    def __init__(self, inside: Callable[[], bool]) -> None:
        super().__init__()
        self.inside = inside
        self.seconds = 0.0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.inside():
            return func(*args, **(kwargs or {}))
        start = time.perf_counter()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.seconds += time.perf_counter() - start


def torch_ops_ms(mon: Monitor, run: Callable[[int], None], clock: _Clock) -> float | None:
    """Median milliseconds per unsampled step of the torch ops stabkit's entry points call: `PROFILED`
    unsampled steps (sampled ones and log intervals run through untimed) under a dispatch mode that
    times each op called inside an entry point (`_OpTimer`). Its Python is the timed steps' time in
    stabkit less this (`InHook.python_ms`)."""
    every, log_every = mon.config.every, mon.config.log_every
    seconds: list[float] = []
    for _ in range(4 * PROFILED):
        if len(seconds) == PROFILED:
            break
        step = mon.global_step
        if step % every == 0 or (step + 1) % log_every == 0:
            run(1)
            continue
        timer = _OpTimer(clock.busy)
        with timer:
            run(1)
        seconds.append(timer.seconds)
    return 1e3 * statistics.median(seconds) if seconds else None


def _timed(fn: Callable[[], None], durations: list[float]) -> Callable[[], None]:
    """`fn` that appends each call's seconds to `durations`."""

    @functools.wraps(fn)
    def timed() -> None:
        start = time.perf_counter()
        try:
            fn()
        finally:
            durations.append(time.perf_counter() - start)

    return timed


def _summary(rows: list[tuple[bool, dict[str, float]]]) -> InHook:
    def median_ms(kind: bool) -> float | None:
        totals = [sum(spent.values()) for s, spent in rows if s == kind]
        return 1e3 * statistics.median(totals) if totals else None

    quiet = [spent for s, spent in rows if not s]
    chosen = quiet or [spent for _, spent in rows]
    keys = {k for spent in chosen for k in spent}
    top = {k: 1e3 * statistics.median(spent.get(k, 0.0) for spent in chosen) for k in keys}
    ordered = dict(sorted(top.items(), key=lambda kv: -kv[1]))
    sampled = sum(s for s, _ in rows)
    return InHook(
        median_ms(True),
        median_ms(False),
        ordered,
        "unsampled" if quiet else "sampled",
        sampled_steps=sampled,
        unsampled_steps=len(rows) - sampled,
    )
