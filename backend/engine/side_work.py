"""Work other components hand to the engine's thread, run between its steps (or decoder layers).

The engine knows nothing about what a job computes. A job queued before the engine stops either
runs or fails with the engine's error; none is left unanswered.

While the engine has requests, side work gets at most `SIDE_WORK_SHARE` of the engine thread's time:
each step's own time earns side work credit (share / (1 - share) of it, banked up to
`MAX_CREDIT_S`), a job runs only while the credit is positive and its run time is taken from it (a
long job leaves a debt the next steps pay off). So one tenant's megabyte of first-sight embedding
can slow the steps every stream shares by that share at most, not stall them for its whole run; an
idle engine runs every queued job at once.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Job:
    fn: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return  # its caller gave up before the engine got to it
        try:
            result = self.fn()
        except BaseException as exc:  # the job's error is its caller's, never the engine thread's
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)


SIDE_WORK_SHARE = 0.25
MAX_CREDIT_S = 0.05


class SideWorkQueue:
    """A thread-safe queue of jobs that the engine thread drains at its safe points, within its share
    of the thread's time while the engine is busy (`busy`, set by the engine thread)."""

    def __init__(self, share: float = SIDE_WORK_SHARE, max_credit_s: float = MAX_CREDIT_S) -> None:
        if not 0 < share < 1:
            raise ValueError(f"side work share must be between 0 and 1, not {share}")
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._earn = share / (1 - share)
        self._max_credit_s = max_credit_s
        self._credit_s = max_credit_s
        self.busy = False  # the engine has requests: side work runs on credit
        self.jobs_run = 0  # observability and tests
        self.spent_s = 0.0  # the engine thread's time spent on side work, in all

    def put(self, job: Job) -> None:
        self._jobs.put(job)

    @property
    def pending(self) -> bool:
        return not self._jobs.empty()

    def earn(self, engine_seconds: float) -> None:
        """The engine spent `engine_seconds` on its own work (a step, side work excluded)."""
        self._credit_s = min(self._max_credit_s, self._credit_s + max(0.0, engine_seconds) * self._earn)

    def run_pending(self) -> None:
        """Run queued jobs (all of them when the engine is idle, while the credit lasts when it is
        busy); cheap when none is queued (checked once per decoder layer)."""
        while not self._jobs.empty():
            if self.busy and self._credit_s <= 0:
                return
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            self.jobs_run += 1  # before: a caller woken by the job's result may read it at once
            started = time.perf_counter()
            job.run()
            took = time.perf_counter() - started
            self.spent_s += took
            if self.busy:
                self._credit_s -= took

    def fail_pending(self, error: BaseException, lock: threading.Lock) -> None:
        """The engine thread is ending: queued jobs will never run."""
        with lock:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    return
                if job.future.set_running_or_notify_cancel():
                    job.future.set_exception(error)
