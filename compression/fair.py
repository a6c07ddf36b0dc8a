"""Compression work shared fairly between tenants.

A plain thread pool serves jobs in arrival order: with one worker, one tenant's 1M-character
document holds every other tenant's small request behind it for the whole of its run. Here each
tenant has its own queue, and the `slots` (the compression worker budget: how many jobs may run
Python at once) go to the waiting tenant that has used the least worker time lately (seconds
used, halved every `half_life_s`; ties: the one served least recently). A running job also gives
its slot up at yield points (`yield_turn`, between embedding chunks and between stages) once it
has run `slice_s` and a tenant that has used less is waiting: its thread parks, that tenant's job
runs, and the long job resumes when its turn comes back. So a small request waits about one slice
of someone else's work, not the whole of it, and runs at its own speed (it has used less than the
big one until it is done); tenants that all keep the workers busy share them equally.

With a `pacer` (the gateway's per-tenant CPU share), each job's CPU time is charged to its tenant
at every yield point, and a job whose tenant is over its share gives its slot up and sleeps there
(holding no lock) until the pacer lets it go on.

    scheduler = FairScheduler(slots=1)
    future = scheduler.submit("tenant-b", function, *args)   # concurrent.futures.Future
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

DEFAULT_SLICE_S = 0.05
DEFAULT_HALF_LIFE_S = 2.0
FORGET_BELOW_S = 0.001  # a tenant idle with less use than this is forgotten (counts as new)


PACE_RECHECK_S = 0.25


class Pacer(Protocol):
    """Per-tenant CPU accounting the workers report to (ctxgate.gateway.cpu_share.TenantCpuShare)."""

    def charge(self, tenant: str, seconds: float) -> None: ...

    def wait_s(self, tenant: str) -> float:
        """How long the tenant's work should pause now (0: go on)."""
        ...


@dataclass
class _Job:
    function: Callable[..., Any]
    args: tuple[Any, ...]
    future: Future[Any]


@dataclass
class _Parked:
    """A running job that gave its slot up at a yield point; its thread waits for `granted`."""

    granted: bool = False


@dataclass
class _Tenant:
    queue: deque[_Job | _Parked] = field(default_factory=deque)
    last_served: int = 0  # the dispatch tick of its last turn; 0: never served
    running: int = 0  # its jobs holding a slot or parked
    used_s: float = 0.0  # worker seconds, decayed to `used_at`
    used_at: float = 0.0

    def used(self, now: float, half_life_s: float) -> float:
        return self.used_s * 0.5 ** ((now - self.used_at) / half_life_s)

    def charge(self, seconds: float, now: float, half_life_s: float) -> None:
        self.used_s = self.used(now, half_life_s) + seconds
        self.used_at = now


class _Turn(threading.local):
    """The job this thread runs, for `yield_turn`."""

    scheduler: FairScheduler | None = None
    tenant: str = ""
    started: float = 0.0
    cpu_mark: float = 0.0  # the thread's CPU clock when the job's CPU was last charged to the pacer


_turn = _Turn()


def yield_turn() -> None:
    """Let another tenant's compression run if this job has had its slice and one is waiting; a no-op
    outside a FairScheduler job (index builds, evaluations, direct pipeline calls)."""
    scheduler = _turn.scheduler
    if scheduler is not None:
        scheduler._yield(_turn.tenant)


def charge_turn(seconds: float) -> None:
    """Charge time another thread spent for the job this thread runs (the engine thread's embedding
    passes) to its tenant's pacer, as its own CPU is; a no-op outside a paced job."""
    scheduler = _turn.scheduler
    if scheduler is not None and scheduler.pacer is not None:
        scheduler.pacer.charge(_turn.tenant, seconds)


class FairScheduler:
    """Per-tenant queues served round-robin by `slots` running jobs, with preemption at yield points."""

    def __init__(
        self,
        slots: int,
        *,
        slice_s: float = DEFAULT_SLICE_S,
        half_life_s: float = DEFAULT_HALF_LIFE_S,
        name: str = "ctxgate-compress",
        initializer: Callable[[], None] | None = None,
        on_thread_exit: Callable[[], None] | None = None,
        pacer: Pacer | None = None,
    ):
        if slots < 1:
            raise ValueError(f"slots must be at least 1, not {slots}")
        self.slots = slots
        self.slice_s = slice_s
        self.half_life_s = half_life_s
        self._name = name
        self._initializer = initializer
        self._on_thread_exit = on_thread_exit
        self.pacer = pacer
        self._lock = threading.Condition()
        self._tenants: dict[str, _Tenant] = {}
        self._free = slots
        self._ready: deque[tuple[str, _Job]] = deque()  # jobs given a slot, for an idle thread to start
        self._idle = 0  # threads waiting for a ready job
        self._threads = 0
        self._ticks = itertools.count(1)
        self._closed = False
        self.preemptions = 0  # yield points that handed the slot to another tenant
        self.pauses = 0  # yield points where a job over its tenant's CPU share slept

    def submit(self, tenant: str, function: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the compression scheduler is shut down")
            self._tenants.setdefault(tenant, _Tenant()).queue.append(_Job(function, args, future))
            self._dispatch()
        return future

    def waiting(self) -> dict[str, int]:
        """Queued turns per tenant (new jobs and parked ones)."""
        with self._lock:
            return {name: len(t.queue) for name, t in self._tenants.items() if t.queue}

    def shutdown(self, cancel_futures: bool = True) -> None:
        with self._lock:
            self._closed = True
            for tenant in self._tenants.values():
                for turn in tenant.queue:
                    if isinstance(turn, _Parked):
                        turn.granted = True  # runs to its end: its caller is waiting on it
                    elif cancel_futures:
                        turn.future.cancel()
                tenant.queue.clear()
            self._lock.notify_all()

    # -- under the lock -------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Give free slots to the waiting tenants that have used the workers least lately."""
        now = time.perf_counter()
        while self._free > 0:
            waiting = [
                (t.used(now, self.half_life_s), t.last_served, name)
                for name, t in self._tenants.items()
                if t.queue
            ]
            if not waiting:
                break
            *_, name = min(waiting)
            tenant = self._tenants[name]
            turn = tenant.queue.popleft()
            tenant.last_served = next(self._ticks)
            self._free -= 1
            if isinstance(turn, _Parked):
                turn.granted = True
            else:
                tenant.running += 1
                self._ready.append((name, turn))
                if len(self._ready) > self._idle:
                    self._start_thread()
            self._lock.notify_all()
        # Idle tenants whose use has decayed away are forgotten: a stream of names holds no memory.
        for name in [
            name
            for name, t in self._tenants.items()
            if not t.queue and not t.running and t.used(now, self.half_life_s) < FORGET_BELOW_S
        ]:
            del self._tenants[name]

    def _someone_owed(self, tenant: str, now: float) -> bool:
        """Whether another tenant is waiting that has used the workers less than `tenant`."""
        mine = self._tenants[tenant].used(now, self.half_life_s)
        return any(
            t.queue and t.used(now, self.half_life_s) < mine
            for name, t in self._tenants.items()
            if name != tenant
        )

    def _start_thread(self) -> None:
        self._threads += 1
        self._idle += 1  # counted idle until it takes a job, so one dispatch does not start two
        threading.Thread(target=self._work, name=f"{self._name}-{self._threads}", daemon=True).start()

    # -- worker threads -------------------------------------------------------------------------
    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer()
        try:
            while True:
                with self._lock:
                    while not self._ready and not self._closed:
                        self._lock.wait()
                    if not self._ready:
                        return
                    self._idle -= 1
                    tenant, job = self._ready.popleft()
                self._run(tenant, job)
                with self._lock:
                    self._free += 1
                    record = self._tenants[tenant]
                    record.running -= 1
                    now = time.perf_counter()
                    record.charge(now - _turn.started, now, self.half_life_s)
                    self._idle += 1  # before dispatching: the next ready job may be this thread's
                    self._dispatch()
                    # Parked jobs' threads came on top of the slots; spares beyond them end.
                    if self._idle > self.slots:
                        self._idle -= 1
                        self._threads -= 1
                        return
        finally:
            if self._on_thread_exit is not None:
                self._on_thread_exit()

    def _run(self, tenant: str, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        _turn.scheduler, _turn.tenant, _turn.started = self, tenant, time.perf_counter()
        _turn.cpu_mark = time.thread_time()
        try:
            result = job.function(*job.args)
        except BaseException as exc:  # noqa: BLE001 (handed to the caller, as a thread pool does)
            job.future.set_exception(exc)
        else:
            job.future.set_result(result)
        finally:
            _turn.scheduler = None
            self._charge_cpu(tenant)

    def _charge_cpu(self, tenant: str) -> None:
        if self.pacer is not None:
            now = time.thread_time()
            self.pacer.charge(tenant, now - _turn.cpu_mark)
            _turn.cpu_mark = now

    def _pace(self, tenant: str) -> None:
        """Charge the job's CPU so far; over its tenant's share, give the slot up and sleep until the
        pacer lets it go on, then wait for a slot like a parked job."""
        pacer = self.pacer
        if pacer is None:
            return
        self._charge_cpu(tenant)
        if pacer.wait_s(tenant) <= 0 or self._closed:
            return
        with self._lock:
            self._free += 1
            self.pauses += 1
            self._dispatch()
        while (wait_s := pacer.wait_s(tenant)) > 0 and not self._closed:
            time.sleep(min(wait_s, PACE_RECHECK_S))
        with self._lock:
            parked = _Parked(granted=self._closed)
            if not parked.granted:
                self._tenants[tenant].queue.appendleft(parked)
                self._dispatch()
            while not parked.granted:
                self._lock.wait()
        _turn.started = time.perf_counter()
        _turn.cpu_mark = time.thread_time()

    def _yield(self, tenant: str) -> None:
        self._pace(tenant)
        now = time.perf_counter()
        if now - _turn.started < self.slice_s:
            return
        with self._lock:
            record = self._tenants[tenant]
            record.charge(now - _turn.started, now, self.half_life_s)
            _turn.started = now
            if self._closed or not self._someone_owed(tenant, now):
                return
            parked = _Parked()
            # At the front of its own queue: the tenant's own newer jobs do not overtake it.
            record.queue.appendleft(parked)
            self._free += 1
            self.preemptions += 1
            self._dispatch()
            while not parked.granted:
                self._lock.wait()
        _turn.started = time.perf_counter()
