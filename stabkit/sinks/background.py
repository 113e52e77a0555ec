"""`Background`: one thread that runs a tracker's calls in order, so training never waits for the
tracking store or server (a SQLite store took 0.1–1 s per thousand metric values on our CPUs; a remote
server adds a network round trip per batch; an unreachable one retries for minutes).

Jobs are submitted from the training thread (`submit`, at each log interval, at `attach` and
`detach`). The training thread waits at most `budget` seconds in any one call (`submit` with a full
queue, `wait`, `stop`): `stop` at `detach` hands what is still queued to the thread, which goes on
writing after `detach` returns (and at interpreter exit gets `stall` seconds more to finish); an
error it meets then is reported from the thread (`late`: one warning).

A job's error is kept and raised in the training thread at the next `submit`, `wait` or `check`,
where `SinkSet` catches it, warns once and switches the sink off; later jobs are dropped. A job that
runs longer than `stall` seconds means the store stopped answering: `check` raises TrackerError
saying so, with the cause when `diagnose` finds one (``connection refused``).

`idle`, when given, runs on the thread every `tick` seconds while no job waits (the W&B sink paces a
joined run's rows with it).
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

from .trackers import TrackerError

BUDGET = 2.0
"""Longest the training thread waits for a tracker in one call, in seconds (a step, `detach`)."""
STALL = 30.0
"""A tracker call running longer than this (seconds) means the store stopped answering."""

_LIVE: weakref.WeakSet[Background] = weakref.WeakSet()
"""Writers whose thread may still be writing after `stop` (drained at interpreter exit)."""


class Background:
    """A daemon thread running submitted jobs one at a time, in order; at most `limit` wait."""

    def __init__(
        self,
        name: str,
        limit: int = 8,
        budget: float | None = None,
        stall: float | None = None,
        diagnose: Callable[[], str | None] | None = None,
        idle: Callable[[], None] | None = None,
        tick: float = 0.05,
        late: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.name = name
        self.limit = limit
        self.budget = BUDGET if budget is None else budget
        """Longest the caller waits in one call (default `BUDGET`)."""
        self.stall = STALL if stall is None else stall
        """A job running longer means the store stopped answering (default `STALL`)."""
        self.diagnose = diagnose
        self.idle = idle
        self.tick = tick
        self.late = late
        """Told, on the thread, of an error no caller will see any more (it came after `stop`)."""
        self._left = False
        """`stop` returned with jobs still to run: the thread reports its own errors (`late`)."""
        self._jobs: deque[tuple[Callable[[], None], str]] = deque()
        self._doing: str | None = None
        """What the running job does (None when idle)."""
        self._since = 0.0
        """When the running job started (`time.monotonic`)."""
        self._stopped = False
        self._error: BaseException | None = None
        self._stuck: str | None = None
        """Why the thread is taken to hang (said once found; later calls do not wait for it)."""
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"stabkit {name} writer", daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def _run(self) -> None:
        while True:
            with self._cond:
                wait = self.tick if self.idle is not None else None
                self._cond.wait_for(lambda: bool(self._jobs) or self._stopped, wait)
                if not self._jobs:
                    if self._stopped:
                        return
                    job, what = self.idle, "pace rows"
                else:
                    job, what = self._jobs.popleft()
                self._doing, self._since = what, time.monotonic()
            try:
                if self._error is None and job is not None:
                    job()
            except BaseException as exc:  # kept, raised in the training thread
                with self._cond:
                    self._error = exc
                    left = self._left
                if left and self.late is not None:
                    self.late(exc)
            finally:
                with self._cond:
                    self._doing = None
                    self._cond.notify_all()

    @property
    def backlog(self) -> int:
        """Jobs queued and not yet started."""
        return len(self._jobs)

    def room(self) -> bool:
        """True when a job can be queued without waiting."""
        return len(self._jobs) < self.limit

    def check(self) -> None:
        """Raise the error a job raised, if one did, or TrackerError when a job has run longer than
        `stall` seconds (with the cause `diagnose` finds, once)."""
        if self._error is not None:
            raise self._error
        if self._stuck is None:
            doing, since = self._doing, self._since
            if doing is None or time.monotonic() - since <= self.stall:
                return
            cause = self.diagnose() if self.diagnose is not None else None
            self._stuck = f"{self.name} has not answered for {time.monotonic() - since:.0f} s ({doing})" + (
                f": {cause}" if cause else ""
            )
        raise TrackerError(self._stuck)

    def submit(self, job: Callable[[], None], what: str = "write") -> None:
        """Queue `job` (`what` says what it does, for messages); waits at most `budget` seconds while
        `limit` jobs wait, then TrackerError."""
        self.check()
        with self._cond:
            if self._stopped:
                raise TrackerError(f"{self.name}: writer already stopped")
            if not self._cond.wait_for(lambda: len(self._jobs) < self.limit, self.budget):
                self.check()
                raise TrackerError(
                    f"{self.name} is not keeping up: {len(self._jobs)} writes still queued after "
                    f"{self.budget:g} s (now: {self._doing})"
                )
            self._jobs.append((job, what))
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted job has run, at most `timeout` seconds (default `budget`);
        raise a job's error. False when jobs were still running or queued then."""
        limit = self.budget if timeout is None else timeout
        with self._cond:
            done = self._cond.wait_for(lambda: not self._jobs and self._doing is None, limit)
        self.check()
        return done

    def stop(self) -> bool:
        """No more jobs: wait at most `budget` seconds (not at all once stuck or failed) for the
        queue to be written; what is left goes on in the background. Raises a job's error. True
        when the thread has finished."""
        with self._cond:
            self._stopped = True
            if self._error is not None or self._stuck is not None:
                self._jobs.clear()
            self._cond.notify_all()
        self._thread.join(0 if self._stuck is not None else self.budget)
        with self._cond:
            alive = self._thread.is_alive()
            self._left = alive and self._error is None and self._stuck is None
            error = self._error
        if error is not None:
            raise error
        if self._stuck is not None:
            raise TrackerError(self._stuck)
        return not alive

    def join(self, timeout: float) -> bool:
        """Wait at most `timeout` seconds for a stopped writer's thread to end; True when it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


@atexit.register
def _drain() -> None:
    """At interpreter exit: writers still working after `detach` get `stall` seconds in all to finish
    (a hung one is not waited for)."""
    deadline = time.monotonic() + STALL
    for writer in list(_LIVE):
        if writer._stopped and writer._stuck is None and writer._error is None:
            writer.join(max(0.0, deadline - time.monotonic()))
