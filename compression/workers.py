"""The compression workers: threads of their own, each running an event loop of compressions.

A compression is mostly Python (splitting, counting, BM25, the knapsack) around one awaited
embedding, whose forward pass runs on the in-process engine's thread. A worker that compressed one
request at a time left the next one queued while the engine ran the first one's forward pass, and
each request got a forward pass of its own. Here a worker runs every compression it was given as a
task on its own event loop, up to `max_concurrent` at once: while one waits for its embedding, the
others do their Python, and those that reach their embedding before the engine takes the job share
the forward pass (compression.batching.EngineJobBatcher.encode_async). Where the embedding does not
run on the engine (no engine, a child process), a call blocks the worker's loop as it always did.

    workers = CompressionWorkers(count=1, nice=0)
    result = await workers.run(coroutine_function, *args)   # from any other event loop
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Compressions one worker runs at once; the others queue for a slot in arrival order. A burst of
# concurrent cold requests (a RAG app's clients) fits; more at once would only stretch each one's
# Python over the others' and grow the shared forward pass past what is warmed up.
MAX_CONCURRENT_PER_WORKER = 4


class CompressionWorkers:
    """`count` threads with an event loop each; `run` hands a coroutine to the least busy one."""

    def __init__(self, count: int, nice: int = 0, max_concurrent: int = MAX_CONCURRENT_PER_WORKER):
        if count < 1:
            raise ValueError("CompressionWorkers needs at least one worker")
        self.max_concurrent = max_concurrent
        self._workers = [_Worker(index, nice, max_concurrent) for index in range(count)]
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        return len(self._workers)

    async def run(self, function: Callable[..., Awaitable[T]], *args: Any) -> tuple[T, float]:
        """`await function(*args)` on a worker's loop; returns its result and the milliseconds it
        waited for a slot there (apart from its own run)."""
        with self._lock:
            worker = min(self._workers, key=lambda w: w.in_flight)
            worker.in_flight += 1
        try:
            return await asyncio.wrap_future(worker.submit(function, *args))
        finally:
            with self._lock:
                worker.in_flight -= 1

    def call_in_worker(self, function: Callable[[], T], index: int = 0) -> Future[T]:
        """`function()` on worker `index`'s thread, blocking its loop while it runs (for tests and
        for reading a worker thread's own settings)."""
        return self._workers[index].call(function)

    def close(self) -> None:
        for worker in self._workers:
            worker.stop()


class _Worker:
    def __init__(self, index: int, nice: int, max_concurrent: int):
        self.in_flight = 0  # guarded by CompressionWorkers._lock
        self._loop = asyncio.new_event_loop()
        self._slots: asyncio.Semaphore | None = None
        self._max_concurrent = max_concurrent
        self._stopped = False
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, args=(nice, ready), name=f"ctxgate-compress_{index}", daemon=True
        )
        self._thread.start()
        ready.wait()

    def _serve(self, nice: int, ready: threading.Event) -> None:
        init_worker_thread(nice)
        asyncio.set_event_loop(self._loop)
        self._slots = asyncio.Semaphore(self._max_concurrent)
        ready.set()
        try:
            self._loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            if pending:
                self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

    def submit(self, function: Callable[..., Awaitable[T]], *args: Any) -> Future[tuple[T, float]]:
        if self._stopped:
            raise RuntimeError("the compression workers are closed")
        return asyncio.run_coroutine_threadsafe(self._in_slot(function, args, time.perf_counter()), self._loop)

    async def _in_slot(self, function: Callable[..., Awaitable[T]], args: tuple[Any, ...],
                       submitted: float) -> tuple[T, float]:
        assert self._slots is not None
        async with self._slots:
            wait_ms = (time.perf_counter() - submitted) * 1000
            return await function(*args), wait_ms

    def call(self, function: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(function())
            except BaseException as exc:  # handed to the caller
                future.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return future

    def stop(self) -> None:
        self._stopped = True
        if self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(self._loop.stop)
        except RuntimeError:  # closed meanwhile
            return


def init_worker_thread(nice: int) -> None:
    """A compression worker runs torch ops (if any) inline, with no OpenMP team beside the engine's,
    and at `nice` below the process's CPU priority."""
    from backend import openmp

    openmp.limit_calling_thread(1)
    lower_thread_priority(nice)


def lower_thread_priority(nice: int) -> bool:
    """Lower the calling thread's CPU priority by `nice` steps (at most to 19); False where that
    cannot be done for one thread. On Linux a thread is a task of its own and setpriority on its id
    changes that thread only; elsewhere it would renice the whole process, so nothing is done."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return False
    thread_id = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, thread_id)
        os.setpriority(os.PRIO_PROCESS, thread_id, min(19, current + nice))
    except OSError as exc:
        logger.warning("could not lower the compression worker's CPU priority: %s", exc)
        return False
    return True
