"""`Background`: one thread that runs a tracker's writes in order, so training does not wait for
the tracking store (a SQLite store took 0.1–1 s per thousand metric values on our CPUs; a remote
server adds a network round trip per batch).

Jobs are submitted from the training thread (`submit`, at each log interval); `wait` blocks until
every job submitted so far has run (on events and at close). A job's error is kept and raised in the
training thread at the next `submit`, `wait` or `check` — where `SinkSet` catches it, warns once and
switches the sink off; later jobs are dropped. A store that stops answering blocks no longer than
`timeout` seconds: then TrackerError.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from .trackers import TrackerError


class Background:
    """A daemon thread running submitted jobs one at a time, in order; at most `limit` wait."""

    def __init__(self, name: str, limit: int = 8, timeout: float = 120.0) -> None:
        self.name = name
        self.limit = limit
        self.timeout = timeout
        self._jobs: deque[Callable[[], None]] = deque()
        self._busy = False
        self._stopped = False
        self._error: BaseException | None = None
        self._stuck = False
        """A wait timed out: a job hangs; later calls do not wait for it again."""
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"stabkit {name} writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._jobs) or self._stopped)
                if not self._jobs:
                    return
                job = self._jobs.popleft()
                self._busy = True
            try:
                if self._error is None:
                    job()
            except BaseException as exc:  # kept, raised in the training thread
                self._error = exc
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def check(self) -> None:
        """Raise the error a job raised, if one did (or say that a job hangs)."""
        if self._error is not None:
            raise self._error
        if self._stuck:
            raise TrackerError(f"{self.name} did not answer within {self.timeout:g} s")

    def submit(self, job: Callable[[], None]) -> None:
        """Queue `job`; blocks while `limit` jobs wait (at most `timeout` seconds, then TrackerError)."""
        self.check()
        with self._cond:
            if self._stopped:
                raise TrackerError(f"{self.name}: writer already stopped")
            if not self._cond.wait_for(lambda: len(self._jobs) < self.limit, self.timeout):
                self._stuck = True
                raise TrackerError(
                    f"{self.name} is not keeping up: {len(self._jobs)} writes waited over {self.timeout:g} s"
                )
            self._jobs.append(job)
            self._cond.notify_all()

    def wait(self) -> None:
        """Block until every submitted job has run (at most `timeout` seconds); raise a job's error."""
        with self._cond:
            done = self._cond.wait_for(lambda: not self._jobs and not self._busy, self.timeout)
            self._stuck = self._stuck or not done
        self.check()

    def stop(self) -> None:
        """Run what is queued, then end the thread (waiting at most `timeout` seconds, not at all
        when a job already hung); raise a job's error."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(0 if self._stuck else self.timeout)
        self._stuck = self._stuck or self._thread.is_alive()
        self.check()
