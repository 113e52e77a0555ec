"""Nothing lost on a crash: live monitors are flushed at interpreter exit and on SIGTERM.

`register` runs at `attach`; `unregister` at `detach`. The SIGTERM handler is installed once,
from the main thread, and chains to whatever handler was there before (the default one ends
the process with SIGTERM's status, as if stabkit were not there). SIGINT needs no handler: it
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
    """Flush and close every live monitor (at exit, or on SIGTERM). Never raises."""
    for mon in list(_LIVE):
        with contextlib.suppress(Exception):
            mon.close_on_crash()
    _LIVE.clear()


def _install_sigterm() -> None:
    global _previous_sigterm
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be set from the main thread
    with contextlib.suppress(ValueError, OSError):
        _previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    close_all()
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
