"""Work other components hand to the engine's thread, run between its steps (or decoder layers).

The engine knows nothing about what a job computes. A job queued before the engine stops either
runs or fails with the engine's error; none is left unanswered.
"""

from __future__ import annotations

import queue
import threading
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


class SideWorkQueue:
    """A thread-safe queue of jobs that the engine thread drains at its safe points."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self.jobs_run = 0  # observability and tests

    def put(self, job: Job) -> None:
        self._jobs.put(job)

    def run_pending(self) -> None:
        """Run every queued job; cheap when none is queued (checked once per decoder layer)."""
        while not self._jobs.empty():
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            self.jobs_run += 1  # before: a caller woken by the job's result may read it at once
            job.run()

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
