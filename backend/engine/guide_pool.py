"""Grammar compilation that a deadline stops, served fairly across tenants.

xgrammar compiles in C++ without a way to interrupt it, so a thread given a deadline only stops
being waited for: the CPU work runs on. Here each compile runs in a worker process that is killed
(and replaced) when its deadline passes, so the deadline ends the work. The workers are forked from
multiprocessing's forkserver with xgrammar already imported there, so starting one (at warm-up or
after a kill) costs a fork and a tokenizer-info load (~50 ms), not xgrammar's ~3 s import.

What comes back: a compiled grammar's JSON is small for ordinary grammars (a 60-property object:
0.9 MB, 85 ms to write) but can be ~75x its in-memory size (a 900-property one: 3.8 MB in memory,
285 MB and 28 s as JSON). So a worker sends the grammar back only while it is small; a bigger one
the worker has shown to compile within the deadline is compiled again in the server on the same
dispatcher thread (bounded, since the worker just did the same work in time), and its tenant's
turn lasts until that ends.

Fairness: each tenant has at most one compile running; waiting compiles are taken round robin
across tenants, so a tenant flooding slow schemas holds at most one worker while another tenant's
compile goes to the next free one. Each tenant's queue is short and each wait is bounded.
"""

from __future__ import annotations

import concurrent.futures
import logging
import multiprocessing
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)

WORKER_START_TIMEOUT_S = 120.0  # the forkserver's first start imports xgrammar (and torch)
_PRELOAD = ["xgrammar", "ctxgate.backend.engine.guided"]
SEND_BACK_MAX_BYTES = 256 * 1024  # in memory; a bigger compiled grammar is compiled again in the server


class CompileRefused(Exception):
    """A compile that did not run or did not finish; `status` is the HTTP status it deserves."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class CompileFailed(Exception):
    """xgrammar rejected the grammar; the message is its first line."""


@dataclass
class _Job:
    tenant: str
    kind: str
    source: str
    queued_at: float
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)


def _worker_main(conn: Connection, tokenizer_info_json: str) -> None:
    """A worker process: compile (kind, source) requests until told to stop (None)."""
    import signal

    import xgrammar

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C stops the server, which ends its workers

    from ctxgate.backend.engine.guided import compile_source, first_line

    info = xgrammar.TokenizerInfo.deserialize_json(tokenizer_info_json)
    # Our LRU in the parent bounds memory; xgrammar's unbounded cache would not.
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready", ""))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the server went away: nothing left to compile for
            return
        if request is None:
            return
        kind, source = request
        try:
            compiled = compile_source(compiler, kind, source)
        except (RuntimeError, ValueError, TypeError) as exc:
            conn.send(("error", first_line(exc)))
            continue
        if compiled.memory_size_bytes > SEND_BACK_MAX_BYTES:
            conn.send(("compiles", ""))
            continue
        try:
            conn.send(("ok", compiled.serialize_json()))
        except (RuntimeError, ValueError, TypeError) as exc:
            conn.send(("error", first_line(exc)))


class _Worker:
    """One worker process and the pipe to it."""

    def __init__(self, tokenizer_info_json: str):
        context = multiprocessing.get_context("forkserver")
        # Ignored when the forkserver already runs (then each worker imports xgrammar itself).
        context.set_forkserver_preload(_PRELOAD)
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_worker_main, args=(child, tokenizer_info_json), name="ctxgate-guide-worker", daemon=True
        )
        self.process.start()
        child.close()
        if not self.conn.poll(WORKER_START_TIMEOUT_S):
            self.kill()
            raise RuntimeError("grammar worker did not start")
        self.conn.recv()

    def run(self, kind: str, source: str, timeout_s: float) -> tuple[str, str] | None:
        """("ok", serialized grammar) or ("error", message); None when the deadline passed."""
        self.conn.send((kind, source))
        if not self.conn.poll(timeout_s):
            return None
        return self.conn.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(5)
        self.conn.close()


class CompilePool:
    """`workers` worker processes, each fed by its own dispatcher thread from a fair queue."""

    def __init__(
        self,
        tokenizer_info_json: str,
        load: Callable[[str], Any],
        compile_here: Callable[[str, str], Any],
        workers: int,
        timeout_s: float,
        queue_wait_s: float,
        max_queued_per_tenant: int,
    ):
        self._info = tokenizer_info_json
        self._load = load  # a worker's JSON -> the compiled grammar
        self._compile_here = compile_here  # (kind, source) -> the compiled grammar, in this process
        self.timeout_s = timeout_s
        self.queue_wait_s = queue_wait_s
        self._max_queued = max_queued_per_tenant
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()  # order = round-robin order
        self._running: set[str] = set()  # tenants with a compile on a worker
        self._cond = threading.Condition()
        self._closed = False
        self._ready_at: float | None = None  # when a worker first answered: no queue wait counts before
        self._workers: list[_Worker | None] = [None] * workers
        self._threads = [
            threading.Thread(target=self._dispatch, args=(slot,), name=f"ctxgate-guide-{slot}", daemon=True)
            for slot in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, tenant: str, kind: str, source: str) -> concurrent.futures.Future[Any]:
        """A future of the compiled grammar; it raises CompileRefused or CompileFailed."""
        job = _Job(tenant, kind, source, time.monotonic())
        with self._cond:
            if self._closed:
                raise CompileRefused("was not compiled: the server is shutting down", 503)
            queue = self._queues.setdefault(tenant, deque())
            if len(queue) >= self._max_queued:
                raise CompileRefused(
                    f"was not queued: {len(queue)} grammars of this tenant are already waiting "
                    "to compile; retry when they finish",
                    429,
                )
            queue.append(job)
            self._cond.notify()
        return job.future

    def answer_within_s(self) -> float:
        """How long a job submitted now can take at most: its queue wait, the deadline, as long
        again for a big grammar compiled here, plus the workers' start while none is up yet."""
        starting = WORKER_START_TIMEOUT_S if self._ready_at is None else 0.0
        return starting + self.queue_wait_s + 2 * self.timeout_s + 5.0

    def worker_pids(self) -> list[int]:
        """The live workers' process ids (tests watch a killed one go)."""
        with self._cond:
            return [w.process.pid for w in self._workers if w is not None and w.process.pid is not None]

    def close(self) -> None:
        """Refuse what waits, kill the workers (a compile in progress ends with a 503), join."""
        with self._cond:
            self._closed = True
            waiting = [job for queue in self._queues.values() for job in queue]
            self._queues.clear()
            workers = [w for w in self._workers if w is not None]
            self._cond.notify_all()
        for job in waiting:
            if job.future.set_running_or_notify_cancel():
                job.future.set_exception(CompileRefused("was not compiled: the server is shutting down", 503))
        for worker in workers:
            worker.process.kill()
        for thread in self._threads:
            thread.join(10)

    # -- dispatcher threads ---------------------------------------------------------------------

    def _dispatch(self, slot: int) -> None:
        while True:
            worker = self._ensure_worker(slot)
            job = self._next_job()
            if job is None:
                if worker is not None:
                    worker.kill()
                return
            try:
                self._run(slot, worker, job)
            finally:
                with self._cond:
                    self._running.discard(job.tenant)
                    self._cond.notify_all()

    def _ensure_worker(self, slot: int) -> _Worker | None:
        worker = self._workers[slot]
        backoff_s = 1.0
        while worker is None and not self._closed:
            try:
                worker = _Worker(self._info)
            except Exception:  # retried: compiles wait for a worker, each within its own bound
                logger.exception("starting a grammar worker failed; retrying in %.0f s", backoff_s)
                time.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, 30.0)
                continue
            with self._cond:
                self._workers[slot] = worker
                if self._ready_at is None:
                    self._ready_at = time.monotonic()
        return worker

    def _next_job(self) -> _Job | None:
        """The next tenant's oldest job, round robin over tenants with nothing running; None: closed."""
        with self._cond:
            while not self._closed:
                for tenant in list(self._queues):
                    if tenant in self._running:
                        continue
                    queue = self._queues[tenant]
                    job = self._live_job(queue)
                    if not queue:
                        del self._queues[tenant]
                    if job is None:
                        continue
                    if queue:
                        self._queues.move_to_end(tenant)  # its next job waits behind the others' turns
                    self._running.add(tenant)
                    return job
                self._cond.wait(1.0)  # also wakes to expire jobs that waited too long
            return None

    def _live_job(self, queue: deque[_Job]) -> _Job | None:
        """Pop the first job still wanted: cancelled ones are dropped, too-old ones answered."""
        now = time.monotonic()
        while queue:
            job = queue.popleft()
            if not job.future.set_running_or_notify_cancel():
                continue  # the client went away
            # Time spent before any worker was up (the server's start) is not the tenant's wait.
            waited = now - max(job.queued_at, self._ready_at or now)
            if waited > self.queue_wait_s:
                job.future.set_exception(
                    CompileRefused(f"waited {self.queue_wait_s:g}s for a grammar compiler; retry", 503)
                )
                continue
            return job
        return None

    def _run(self, slot: int, worker: _Worker | None, job: _Job) -> None:
        if worker is None:
            job.future.set_exception(CompileRefused("was not compiled: the server is shutting down", 503))
            return
        try:
            answer = worker.run(job.kind, job.source, self.timeout_s)
        except (OSError, EOFError):
            answer = ("crashed", "")
        if answer is not None and answer[0] in ("ok", "compiles"):
            try:
                if answer[0] == "ok":
                    job.future.set_result(self._load(answer[1]))
                else:
                    job.future.set_result(self._compile_here(job.kind, job.source))
            except Exception as exc:  # the same grammar compiled in the worker; this is unexpected
                logger.exception("a grammar the worker compiled failed here (%s)", job.kind)
                job.future.set_exception(CompileFailed(type(exc).__name__))
            return
        if answer is not None and answer[0] == "error":
            job.future.set_exception(CompileFailed(answer[1]))
            return
        if self._closed:  # `close` killed the worker
            worker.kill()
            job.future.set_exception(CompileRefused("was not compiled: the server is shutting down", 503))
            return
        # Past the deadline (or the worker died): kill it so the work ends, and start its successor
        # now, so the next compile does not pay for the start.
        with self._cond:
            self._workers[slot] = None
        worker.kill()
        if answer is None:
            job.future.set_exception(
                CompileRefused(f"did not compile within {self.timeout_s:g}s; simplify it")
            )
        else:
            logger.error(
                "a grammar worker died while compiling (%s, %d characters)", job.kind, len(job.source)
            )
            job.future.set_exception(CompileRefused("could not be compiled (the compiler failed)"))
