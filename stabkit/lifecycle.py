"""Nothing lost on a crash: live monitors are flushed at interpreter exit and on SIGTERM.

`register` runs at `attach`; `unregister` at `detach`. The SIGTERM handler is installed once,
from the main thread, and chains to whatever handler was there before:

- the user's own handler (the preemption pattern: set a flag, finish the step, checkpoint, exit 0):
  stabkit's handler asks every live monitor to flush at each of its coming `Monitor.step` calls and
  then calls the user's handler. Monitors stay attached and usable until the process really ends
  (`detach`, the end of a `with` block, or the exit hook).
- SIG_IGN: the same, without calling anything.
- the default (no handler): every monitor is flushed and closed, then the process ends with
  SIGTERM's status, as if stabkit were not there.

Flushing in the handler itself would drain the statistics while the interrupted code may be in the
middle of writing them; the flush therefore happens at the next `Monitor.step`, a safe point. What
the sinks already wrote is on disk at once (they flush every write). SIGINT needs no handler: it
raises KeyboardInterrupt, which unwinds through `with attach(...)` and reaches the exit hook.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
import weakref
from types import FrameType
from typing import Any, Protocol


class Flushable(Protocol):
    """What lifecycle needs of a Monitor (also `flush_every_step` and `dist`, set and read with getattr)."""

    def flush(self) -> None: ...

    def close_on_crash(self) -> None: ...


_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()
_previous_sigterm: Any = None
_installed = False


def register(monitor: Flushable) -> None:
    """Track `monitor` until it is detached; install the exit and SIGTERM hooks on first use."""
    global _installed
    _LIVE.add(monitor)
    if not _installed:
        _installed = True
        atexit.register(close_all)
        _install_sigterm()


def unregister(monitor: Flushable) -> None:
    """Stop tracking `monitor` (it was detached)."""
    _LIVE.discard(monitor)


def close_all() -> None:
    """Flush and close every live monitor (at exit, or on a SIGTERM that ends the process). Never raises."""
    for mon in list(_LIVE):
        with contextlib.suppress(Exception):
            mon.close_on_crash()
    _LIVE.clear()


def flush_soon() -> None:
    """On SIGTERM: every live monitor flushes from its next `Monitor.step` on, every step. Not under
    torch.distributed, where a flush is a collective that every rank must reach at the same step
    (ranks get the signal at different steps); there the sinks' own per-write flushes stand."""
    for mon in list(_LIVE):
        if getattr(getattr(mon, "dist", None), "active", False):
            continue
        mon.flush_every_step = True  # the process may end any time: write every step out at once


def chain(previous: Any, signum: int, frame: FrameType | None) -> None:
    """Pass a signal on to `previous` (a handler as `signal.signal` returned it): call it; ignore the
    signal for SIG_IGN; for the default (or an unknown, non-Python handler) close every monitor and
    end the process with the signal's own status."""
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    else:
        close_all()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _install_sigterm() -> None:
    global _previous_sigterm
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    with contextlib.suppress(ValueError, OSError):
        _previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """stabkit's SIGTERM handler (runs in the main thread, between two bytecodes of whatever ran)."""
    flush_soon()
    chain(_previous_sigterm, signum, frame)
