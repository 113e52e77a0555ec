"""SIGTERM as a stop request while a recipe runs (`run_recipe`, `run_sweep`, `stabkit run --nproc`).

Without it a SIGTERM (a job scheduler, `kill`, `timeout`) ends the parent at once: its worker
processes train on as orphans and the summary says neither "complete" nor "interrupted". Inside
`SigtermStop`, the first SIGTERM only sets `hit` — the runner asks its workers to stop at their next
step as on Ctrl-C (logs flushed, status "interrupted") and writes the summary; a second SIGTERM raises
KeyboardInterrupt (stop waiting). Outside the block (or from a thread other than the main one) the
handler passes the signal on to the handler that was there before (`lifecycle.chain`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from types import FrameType, TracebackType
from typing import Any

from ....lifecycle import chain


class SigtermStop:
    """Context manager: while active, SIGTERM asks the run to stop instead of ending the process."""

    def __init__(self) -> None:
        self.hit = False
        """Whether a SIGTERM arrived while the block ran."""
        self.active = False
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> SigtermStop:
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, OSError):
                self._previous = signal.signal(signal.SIGTERM, self._handle)
                self._installed = True
        self.active = True
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.active = False
        # put the old handler back, unless another one was installed on top of this one since (a
        # monitor attached in this process chains to it: it then passes signals on, see `_handle`)
        if self._installed and signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self.active:
            chain(self._previous, signum, frame)
            return
        if self.hit:
            raise KeyboardInterrupt("second SIGTERM")
        self.hit = True

    def __call__(self) -> bool:
        """As a `should_stop` callback: True once a SIGTERM arrived."""
        return self.hit
