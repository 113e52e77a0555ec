"""Run jobs side by side: in worker processes (spawn, one torch thread each) or in this process
(one after another; also each rank of a data-parallel run, where every rank runs every job).

`execute` runs in the parent for the whole command. Workers ignore Ctrl-C; the parent catches it
(or sees `should_stop()` turn true: a SIGTERM, see `signals.SigtermStop`), sets a shared stop flag
(each worker ends at its next step, logs flushed, status "interrupted"), cancels the jobs that have
not started and waits for the rest; a second Ctrl-C, or a worker that does not stop within
`STOP_GRACE_S`, ends the workers at once. A worker whose parent is gone (killed with SIGKILL) stops
at its next step too, so no worker trains on as an orphan.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import signal
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

import torch

from ..results.run_result import FAILED, INTERRUPTED, NOT_RUN, RunResult, Status
from .job import Job, Progress
from .worker import run_job

STOP_GRACE_S = 60.0

_queue: Any = None
_stop: Any = None
_parent = 0


def _init_worker(queue: Any, stop: Any, parent: int) -> None:
    """Pool initializer: one torch thread, Ctrl-C left to the parent (SIGTERM keeps its default: a
    worker ends, its logs flushed by `stabkit.lifecycle`)."""
    global _queue, _stop, _parent
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    _queue, _stop, _parent = queue, stop, parent


def _should_stop() -> bool:
    """Asked by the worker after each step: the parent asked to stop, or the parent is gone."""
    return bool(_stop.is_set()) or os.getppid() != _parent


def _work(job: Job) -> RunResult:
    result = run_job(job, progress=lambda *msg: _queue.put(msg), should_stop=_should_stop)
    if os.getppid() != _parent:  # orphaned: nobody takes the result or sends the next job
        os._exit(1)  # the monitor is detached and its logs flushed already
    return result


def not_run(job: Job, status: Status = NOT_RUN, error: str = "") -> RunResult:
    """The result of a job that never ran (cancelled) or whose process died."""
    return RunResult.not_run(job.variant, job.name, job.logdir, status, error)


def execute(
    jobs: Sequence[Job],
    workers: int,
    on_progress: Progress | None = None,
    on_result: Callable[[Job, RunResult], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> bool:
    """Run `jobs` with `workers` processes (1: in this process); returns True when interrupted.

    `on_progress(run, status, step, total, loss)` and `on_result(job, result)` are called in this
    process, results as soon as each job ends, in completion order. `should_stop` is asked after each
    step (in this process) or every poll (with workers); when it says yes the jobs end as on Ctrl-C.
    Data-parallel jobs (`Job.ddp`) always run in this process.
    """
    report = on_progress or (lambda *a: None)
    deliver = on_result or (lambda j, r: None)
    if workers <= 1 or len(jobs) <= 1 or any(job.ddp for job in jobs):
        return _in_process(jobs, report, deliver, should_stop)
    ctx = mp.get_context("spawn")
    queue, stop = ctx.Queue(), ctx.Event()
    interrupted = False
    executor = ProcessPoolExecutor(
        min(workers, len(jobs)),
        mp_context=ctx,
        initializer=_init_worker,
        initargs=(queue, stop, os.getpid()),
    )
    futures: dict[Future[RunResult], Job] = {executor.submit(_work, job): job for job in jobs}
    pending = set(futures)
    deadline = None

    def interrupt() -> None:
        nonlocal interrupted, pending, deadline
        interrupted = True
        stop.set()
        for f in pending:
            if f.cancel():
                deliver(futures[f], not_run(futures[f]))
        pending = {f for f in pending if not f.cancelled()}
        deadline = time.monotonic() + STOP_GRACE_S

    try:
        while pending:
            try:
                if not interrupted and should_stop is not None and should_stop():
                    interrupt()
                pending = _poll(pending, futures, queue, report, deliver, interrupted)
                if deadline is not None and time.monotonic() > deadline:
                    break
            except KeyboardInterrupt:
                if interrupted:  # second Ctrl-C: stop waiting
                    break
                interrupt()
    finally:
        if pending:  # workers that did not stop in time
            for proc in list(getattr(executor, "_processes", {}).values()):  # no public API for this
                proc.terminate()
            for f in pending:
                deliver(futures[f], not_run(futures[f], INTERRUPTED, "worker ended before it reported"))
        executor.shutdown(wait=True, cancel_futures=True)
        _drain(queue, report)
    return interrupted


def _poll(
    pending: set[Future[RunResult]],
    futures: dict[Future[RunResult], Job],
    queue: Any,
    report: Progress,
    deliver: Callable[[Job, RunResult], None],
    stopping: bool = False,
) -> set[Future[RunResult]]:
    done, still = wait(pending, timeout=0.1, return_when=FIRST_COMPLETED)
    _drain(queue, report)
    for f in done:
        job = futures[f]
        if f.cancelled():
            continue
        try:
            deliver(job, f.result())
        except Exception as exc:  # the worker process died (BrokenProcessPool) or could not unpickle
            status = INTERRUPTED if stopping else FAILED  # stopping: e.g. SIGTERM to the group
            deliver(job, not_run(job, status, f"{type(exc).__name__}: {exc}"))
    return still


def _drain(queue: Any, report: Progress) -> None:
    while True:
        try:
            msg = queue.get_nowait()
        except (queue_mod.Empty, OSError, ValueError):
            return
        report(*msg)


def _in_process(
    jobs: Sequence[Job],
    report: Progress,
    deliver: Callable[[Job, RunResult], None],
    should_stop: Callable[[], bool] | None,
) -> bool:
    for i, job in enumerate(jobs):
        result = run_job(job, progress=report, should_stop=should_stop)
        deliver(job, result)
        if result.status == INTERRUPTED:
            for rest in jobs[i + 1 :]:
                deliver(rest, not_run(rest))
            return True
    return False
